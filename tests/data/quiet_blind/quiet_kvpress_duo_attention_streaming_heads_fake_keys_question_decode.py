# Citation: NVIDIA/kvpress kvpress/presses/duo_attention_press.py @00a150c3f3bb90313eafe2f61f9790ff232168e4
#   (DuoAttentionPress.__post_init_from_model__, compress), kvpress/attention_patch.py
#   @19a6374541c40339f57ce86ffce4f324b5b7ad4a (search_hyperplane, attention_patch, patch_attention_functions),
#   kvpress/presses/base_press.py @00a150c3 (BasePress.forward_hook, __call__), kvpress/pipeline.py @02e13c86
#   (KVPressTextGenerationPipeline._forward, generate_answer).
# DuoAttention as kvpress fakes it: the cache keeps every key, but after the context is prefilled each layer's
# press marks, for its "streaming" KV heads only, the keys between the sink_size first ones and the recent_size
# last ones of the context (module.masked_key_indices). During the question and answer passes the patched
# attention function overwrites those cached keys with a fake key k per KV group, found by search_hyperplane so
# that exp(<q, k>) = 0 for every query of the group; retrieval heads keep the whole context. The prefill itself
# attends in full (is_causal SDPA) and the question's tokens see each other causally. Batch of one, no padding,
# greedy decoding; the generated tokens are cut from the cache after each answer as the pipeline does.
# The head scores that kvpress downloads from the DuoAttention repository are fixed numbers here (no network), and
# the hook reads the installed transformers' `cache` / `position_ids` kwargs where kvpress reads
# `past_key_values` / `cache_position`.
# Self-check: a hand-written forward with no cache over context + question + answer-so-far, its softmax over an
# explicit keep[head, query, key] (causal; for a streaming head, a query after the context does not see context
# keys sink_size .. context_length - recent_size), gives the same greedy tokens and last logits.
import warnings
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

warnings.filterwarnings("ignore")
torch.manual_seed(0)


# ---------------------------------------------------------------- kvpress/attention_patch.py
def search_hyperplane(X, max_iter: int = 1000):
    """
    Given a tensor X of shape (bsz, seq_len, head_dim), search for an hyperplane Y (bsz, head_dim)
    such that for every i, <X[:, i], Y> <= 0. Returns - 1e5 * Y / ||Y|| ** 2 to ensure exp(<X, Y>) = 0
    """
    Y = X.mean(1)  # this initialization is enough for most cases
    for _ in range(max_iter):
        mask = torch.bmm(X, Y.unsqueeze(-1)) <= 0
        if not mask.any():
            return -1e5 * Y / Y.norm(dim=-1, keepdim=True) ** 2
        Y += (X * mask).sum(1) / mask.sum(1).clamp(min=1)
    raise ValueError("Could not find fake keys such that for every query q, exp(<q, k>) = 0")


def attention_patch(func):
    def wrapper(module, query, key, value, attention_mask, dropout, **kwargs):
        if query.shape[2] == key.shape[2]:
            # Prefilling
            module.masked_key_indices = None
        elif module.masked_key_indices is not None:
            # Decoding: build fake keys k s.t. exp(<q, k>) = 0
            bsz, num_heads, seq_len, head_dim = query.shape
            num_key_value_heads = key.shape[1]
            num_groups = num_heads // num_key_value_heads

            # Build a fake key k per key group such that for every query q, exp(<q, k>) = 0
            q = query.view(bsz, num_key_value_heads, num_groups, seq_len, head_dim)
            q = q.reshape(bsz * num_key_value_heads, num_groups * seq_len, head_dim)
            k = search_hyperplane(q)
            k = k.view(bsz, num_key_value_heads, head_dim)

            # At indices, update the keys to the fake keys
            batch_indices, head_indices, seq_indices = module.masked_key_indices
            key[batch_indices, head_indices, seq_indices] = k[batch_indices, head_indices]

        return func(module, query, key, value, attention_mask, dropout, **kwargs)

    return wrapper


def patch_attention_functions():
    for name, func in list(ALL_ATTENTION_FUNCTIONS.items()):
        ALL_ATTENTION_FUNCTIONS[name] = attention_patch(func)


patch_attention_functions()


# ---------------------------------------------------------------- kvpress/presses/base_press.py
@dataclass
class BasePress:
    def __post_init_from_model__(self, model):
        pass

    def compress(self, module, hidden_states, keys, values, attentions, kwargs):
        raise NotImplementedError("compress method must be implemented in subclass")

    def forward_hook(self, module: nn.Module, input, kwargs: dict, output):
        hidden_states = kwargs["hidden_states"]
        cache = kwargs["cache"]
        cache_layer = cache.layers[module.layer_idx]
        q_len = hidden_states.shape[1]

        # Don't compress after pre-filling
        if kwargs["position_ids"][0, -1] + 1 > q_len:
            return output

        keys, values = cache_layer.keys, cache_layer.values

        keys, values = self.compress(module, hidden_states, keys, values, output[1], kwargs)

        cache_layer.keys = keys
        cache_layer.values = values

        return output

    def __call__(self, model):
        return _PressContext(self, model)


class _PressContext:
    def __init__(self, press, model):
        self.press, self.model, self.hooks = press, model, []

    def __enter__(self):
        self.press.__post_init_from_model__(self.model)
        language_model = self.model.model
        for layer in language_model.layers:
            layer.self_attn.rotary_emb = language_model.rotary_emb
            self.hooks.append(layer.self_attn.register_forward_hook(self.press.forward_hook, with_kwargs=True))

    def __exit__(self, *exc):
        for forward_hook in self.hooks:
            forward_hook.remove()


# ---------------------------------------------------------------- kvpress/presses/duo_attention_press.py
@dataclass
class DuoAttentionPress(BasePress):
    head_compression_ratio: float = 0.0
    on_the_fly_scoring: bool = False
    compression_ratio_: float = field(init=False, default=None)
    recent_size: int = field(init=False, default=None)
    sink_size: int = field(init=False, default=None)
    streaming_mask: torch.Tensor = field(init=False, default=None)

    def __post_init_from_model__(self, model):
        # Load attention pattern from the DuoAttention repo
        self.sink_size, self.recent_size, head_scores = self.load_attention_pattern(model)

        # Define retrieval and streaming heads through a binary mask
        n_pruned = round(head_scores.size * self.head_compression_ratio)
        self.streaming_mask = torch.zeros(head_scores.shape, dtype=bool, device=model.device)
        if n_pruned > 0:
            indices = np.argsort(head_scores, axis=None)[:n_pruned]
            self.streaming_mask[np.unravel_index(indices, head_scores.shape)] = True

    def compress(self, module, hidden_states, keys, values, attentions, kwargs):
        assert module.config._attn_implementation != "eager", "eager mode not supported"
        if self.streaming_mask is None:
            raise ValueError(
                "Streaming mask not initialized. Make sure to call __post_init_from_model__ to initialize this press."
            )
        k_len = keys.shape[2]

        if (self.head_compression_ratio > 0) or (k_len > (self.sink_size + self.recent_size)):
            # Save indices to mask during the attention mechanism. Please refer to attention_patch.py for more details
            masked_keys = torch.zeros_like(keys[..., 0], dtype=torch.bool)
            masked_keys[:, self.streaming_mask[module.layer_idx], self.sink_size : -self.recent_size] = True
            module.masked_key_indices = torch.nonzero(masked_keys, as_tuple=True)

        # Compute the compression ratio
        self.compression_ratio_ = self.streaming_mask.float().mean().item()
        self.compression_ratio_ *= 1 - (self.sink_size + self.recent_size) / k_len

        return keys, values

    @staticmethod
    def load_attention_pattern(model):
        # kvpress fetches config.json (sink_size, recent_size) and full_attention_heads.tsv from
        # mit-han-lab/duo-attention; here: fixed scores of shape (num_hidden_layers, num_key_value_heads)
        head_scores = np.array([[0.91, 0.12, 0.55], [0.08, 0.77, 0.31], [0.64, 0.21, 0.95]])
        head_scores = np.clip(head_scores, 0, 1)
        return 4, 8, head_scores


# ---------------------------------------------------------------- the model
config = LlamaConfig(
    vocab_size=97,
    hidden_size=48,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=6,
    num_key_value_heads=3,
    head_dim=32,
    attention_bias=True,
    max_position_embeddings=256,
    eos_token_id=96,
    bos_token_id=1,
    pad_token_id=0,
    attn_implementation="sdpa",
)
model = LlamaForCausalLM(config).eval()
model.generation_config.eos_token_id = 96
with torch.no_grad():
    for layer in model.model.layers:  # sharper attention than the default init, so that masking matters
        layer.self_attn.q_proj.weight.mul_(6.0)
        layer.self_attn.k_proj.weight.mul_(6.0)
        # a trained model's queries share a direction (what search_hyperplane relies on): a query bias in the
        # slowly rotating rotary dimensions of every head
        bias = torch.zeros(config.num_attention_heads, config.head_dim)
        bias[:, 12:16] = 3.0
        bias[:, 28:32] = 3.0
        layer.self_attn.q_proj.bias.copy_(bias.flatten())


# ---------------------------------------------------------------- kvpress/pipeline.py
class KVPressTextGenerationPipeline:
    def __init__(self, model):
        self.model = model
        self.step_logits = []

    def _forward(self, context_ids, questions_ids, max_new_tokens=6, press=None, cache=None):
        context_length = context_ids.shape[1]

        if cache is None:
            cache = DynamicCache()

        attention_mask = torch.ones(1, context_length, dtype=torch.long)
        context_kwargs = {
            "input_ids": context_ids,
            "attention_mask": attention_mask,
            "position_ids": torch.arange(context_length).unsqueeze(0),
            "past_key_values": cache,
            "logits_to_keep": 1,
            "use_cache": True,
        }

        if press is not None:
            with press(self.model):
                self.model(**context_kwargs)
        else:
            self.model(**context_kwargs)

        answers = []
        for question_ids in questions_ids:
            self.step_logits.append([])
            answer = self.generate_answer(
                question_ids=question_ids, cache=cache, context_length=context_length, max_new_tokens=max_new_tokens
            )
            answers.append(answer)
        return answers

    def generate_answer(self, question_ids, cache, context_length, max_new_tokens):
        cache_seq_lengths = [cache.get_seq_length(layer_idx) for layer_idx in range(len(cache))]

        input_ids = question_ids
        question_length = question_ids.shape[1]
        position_ids = torch.arange(context_length, context_length + question_length).unsqueeze(0)

        model_kwargs = {
            "input_ids": input_ids,
            "position_ids": position_ids,
            "past_key_values": cache,
            "logits_to_keep": 1,
            "use_cache": True,
        }

        # Initial forward pass
        outputs = self.model(**model_kwargs)
        self.step_logits[-1].append(outputs.logits[0, -1])

        generated_ids = [outputs.logits[0, -1].argmax()]

        should_stop_token_ids = self.model.generation_config.eos_token_id
        if not isinstance(should_stop_token_ids, list):
            should_stop_token_ids = [should_stop_token_ids]

        for i in range(max_new_tokens - 1):
            input_ids = generated_ids[-1].unsqueeze(0).unsqueeze(0)
            model_kwargs = {
                "input_ids": input_ids,
                "position_ids": torch.tensor([[context_length + question_length + i]]),
                "past_key_values": cache,
                "logits_to_keep": 1,
                "use_cache": True,
            }
            outputs = self.model(**model_kwargs)
            self.step_logits[-1].append(outputs.logits[0, -1])
            new_id = outputs.logits[0, -1].argmax()
            generated_ids.append(new_id)
            if new_id.item() in should_stop_token_ids:
                break

        # Remove the generated tokens from the cache
        for layer_idx, sequence_length in enumerate(cache_seq_lengths):
            cache.layers[layer_idx].keys = cache.layers[layer_idx].keys[:, :, :sequence_length]
            cache.layers[layer_idx].values = cache.layers[layer_idx].values[:, :, :sequence_length]

        return torch.stack(generated_ids)


# ---------------------------------------------------------------- run
context_length, max_new_tokens = 40, 6
context_ids = torch.randint(2, 96, (1, context_length))
questions_ids = [torch.randint(2, 96, (1, 5)), torch.randint(2, 96, (1, 3))]

press = DuoAttentionPress(head_compression_ratio=0.5)
pipe = KVPressTextGenerationPipeline(model)
with torch.no_grad():
    answers = pipe._forward(context_ids, questions_ids, max_new_tokens=max_new_tokens, press=press)
print("streaming heads (layer, kv head):", press.streaming_mask.nonzero().tolist())
print("compression ratio:", round(press.compression_ratio_, 4))
print("answers:", [a.tolist() for a in answers])


# ---------------------------------------------------------------- reference: no cache, explicit keep matrix
def reference_logits(ids, streaming_mask, sink_size, recent_size, ctx_len):
    """Whole sequence, no cache, eager softmax over keep[h, i, j]; returns the last row's logits."""
    m = model.model
    n_heads, n_kv = config.num_attention_heads, config.num_key_value_heads
    groups = n_heads // n_kv
    L = ids.shape[1]
    pos = torch.arange(L).unsqueeze(0)
    i = torch.arange(L)[:, None]
    j = torch.arange(L)[None, :]
    causal = j <= i
    cut = (i >= ctx_len) & (j >= sink_size) & (j < ctx_len - recent_size)
    h = m.embed_tokens(ids)
    cos, sin = m.rotary_emb(h, pos)
    for layer_idx, layer in enumerate(m.layers):
        attn = layer.self_attn
        x = layer.input_layernorm(h)
        d = attn.head_dim
        q = attn.q_proj(x).view(1, L, n_heads, d).transpose(1, 2)
        k = attn.k_proj(x).view(1, L, n_kv, d).transpose(1, 2)
        v = attn.v_proj(x).view(1, L, n_kv, d).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        out = torch.empty(1, n_heads, L, d)
        for head in range(n_heads):
            kv = head // groups
            keep = causal.clone()
            if streaming_mask is not None and streaming_mask[layer_idx, kv]:
                keep &= ~cut
            s = (q[0, head] @ k[0, kv].T) * d**-0.5
            s = s.masked_fill(~keep, float("-inf"))
            out[0, head] = s.softmax(-1) @ v[0, kv]
        h = h + attn.o_proj(out.transpose(1, 2).reshape(1, L, n_heads * d))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return model.lm_head(m.norm(h))[0, -1]


worst, worst_full = 0.0, 0.0
with torch.no_grad():
    for question_ids, answer, logits_steps in zip(questions_ids, answers, pipe.step_logits):
        for step, got in enumerate(logits_steps):
            ids = torch.cat([context_ids, question_ids, answer[:step].unsqueeze(0)], dim=1)
            ref = reference_logits(ids, press.streaming_mask, press.sink_size, press.recent_size, context_length)
            full = reference_logits(ids, None, press.sink_size, press.recent_size, context_length)
            worst = max(worst, (got - ref).abs().max().item())
            worst_full = max(worst_full, (got - full).abs().max().item())
            assert ref.argmax() == answer[step], (step, ref.argmax(), answer[step])
print(f"max |logits - reference| = {worst:.2e}; vs. all heads retrieval = {worst_full:.2e}")
assert worst < 1e-4, worst
assert worst_full > 1e-2, worst_full
print("OK")
