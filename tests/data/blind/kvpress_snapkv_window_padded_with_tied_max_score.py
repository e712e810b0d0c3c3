# NVIDIA/kvpress#227 (commit 42175e7, "fix: Use scores.max().item() + 1 to prevent silent eviction").
#
# SnapKVPress (kvpress/presses/snapkv_press.py) scores the prompt's keys by the attention the last
# `window_size` prompt queries give them, then pads the score tensor with the observation window itself,
# "using max score to make sure the window is not pruned": F.pad(scores, (0, window_size),
# value=scores.max().item()). The padded value only *ties* the highest prompt score, so in the head that
# holds that maximum ScorerPress.compress's topk may keep that prompt key and drop a key of the
# observation window (one of the last prompt tokens). The decode steps then run over a cache that lost it.
# Fix: pad with scores.max().item() + 1, strictly above every prompt score.
#
# Ported as kvpress wrote it (BasePress.forward_hook registered on each layer's self_attn, ScorerPress
# .compress, SnapKVPress.score / compute_window_attention, the pipeline's greedy generate_answer), on a
# tiny LlamaForCausalLM built from its config (sdpa). transformers 5 passes the cache as `cache` and no
# cache_position to the attention module, so the hook reads those two through the names it is given.
import math
import sys
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import repeat_kv, rotate_half

FIXED = "--fixed" in sys.argv


def get_prerope_query_states(module, hidden_states):
    bsz, q_len, _ = hidden_states.shape
    num_heads = module.config.num_attention_heads
    head_dim = module.head_dim
    query_states = module.q_proj(hidden_states)
    query_states = query_states.view(bsz, q_len, num_heads, head_dim).transpose(1, 2)
    return query_states


def extract_keys_and_values(cache, layer_idx):
    keys = cache.layers[layer_idx].keys
    values = cache.layers[layer_idx].values
    return keys, values


@dataclass
class BasePress:
    def compress(self, module, hidden_states, keys, values, attentions, kwargs):
        raise NotImplementedError("compress method must be implemented in subclass")

    def forward_hook(self, module, input, kwargs, output):
        hidden_states = kwargs["hidden_states"]
        cache = kwargs.get("past_key_values", kwargs.get("cache"))
        cache_layer = cache.layers[module.layer_idx]
        q_len = hidden_states.shape[1]

        # Don't compress after pre-filling
        cache_position = kwargs["position_ids"][0]
        if cache_position[-1] > q_len:
            return output

        keys, values = extract_keys_and_values(cache, module.layer_idx)
        keys, values = self.compress(module, hidden_states, keys, values, output[1], kwargs)
        cache_layer.keys = keys
        cache_layer.values = values
        return output

    @contextmanager
    def __call__(self, model):
        hooks = []
        try:
            language_model = model.model.language_model if hasattr(model.model, "language_model") else model.model
            for layer in language_model.layers:
                layer.self_attn.rotary_emb = language_model.rotary_emb
                hooks.append(layer.self_attn.register_forward_hook(self.forward_hook, with_kwargs=True))
            yield
        finally:
            for forward_hook in hooks:
                forward_hook.remove()


@dataclass
class ScorerPress(BasePress):
    compression_ratio: float = 0.0

    def __post_init__(self):
        assert 0 <= self.compression_ratio < 1, "Compression ratio must be between 0 and 1"

    def score(self, module, hidden_states, keys, values, attentions, kwargs):
        raise NotImplementedError

    def compress(self, module, hidden_states, keys, values, attentions, kwargs):
        if self.compression_ratio == 0:
            return keys, values

        # Compute scores
        scores = self.score(module, hidden_states, keys, values, attentions, kwargs)

        # Get indices of KV pairs with the lowest scores
        k_len = keys.shape[2]
        n_kept = int(k_len * (1 - self.compression_ratio))
        indices = scores.topk(n_kept, dim=-1).indices
        indices = indices.unsqueeze(-1).expand(-1, -1, -1, module.head_dim)

        # Prune keys and values
        keys = keys.gather(2, indices).contiguous()
        values = values.gather(2, indices).contiguous()

        return keys, values


@dataclass
class SnapKVPress(ScorerPress):
    compression_ratio: float = 0.0
    window_size: int = 64
    kernel_size: int = 5

    @staticmethod
    def compute_window_attention(module, hidden_states, keys, window_size, position_embeddings):
        bsz, _, k_len, _ = keys.shape
        num_heads = module.config.num_attention_heads
        head_dim = module.head_dim
        num_key_value_groups = num_heads // module.config.num_key_value_heads

        # Get last window_size queries
        query_states = get_prerope_query_states(module, hidden_states[:, -window_size:])

        # Apply RoPE
        cos, sin = position_embeddings
        cos, sin = cos[:, -window_size:], sin[:, -window_size:]
        query_states = (query_states * cos.unsqueeze(1)) + (rotate_half(query_states) * sin.unsqueeze(1))

        # Compute attention for first q_len - window_size tokens
        key_states = repeat_kv(keys, num_key_value_groups)
        attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) / math.sqrt(head_dim)
        attention_mask = torch.ones_like(attn_weights) * float("-inf")
        attention_mask = torch.triu(attention_mask, diagonal=k_len - window_size + 1)
        attn_weights += attention_mask
        attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query_states.dtype)
        attn_weights = attn_weights[..., :-window_size]

        return attn_weights

    def score(self, module, hidden_states, keys, values, attentions, kwargs):
        bsz, num_key_value_heads, k_len, _ = keys.shape
        num_key_value_groups = module.config.num_attention_heads // num_key_value_heads

        assert (
            hidden_states.shape[1] > self.window_size
        ), f"Query length {hidden_states.shape[1]} should be greater than the window size {self.window_size}"

        if attentions is not None:
            attn_weights = attentions[..., -self.window_size :, : -self.window_size]
        else:
            attn_weights = self.compute_window_attention(
                module, hidden_states, keys, self.window_size, kwargs["position_embeddings"]
            )

        scores = attn_weights.mean(dim=-2)
        scores = F.avg_pool1d(scores, kernel_size=self.kernel_size, padding=self.kernel_size // 2, stride=1)

        # Average per group (https://github.com/FasterDecoding/SnapKV/issues/22)
        scores = scores.view(bsz, num_key_value_heads, num_key_value_groups, k_len - self.window_size)
        scores = scores.mean(2)

        # Add back the observation window. Use max score to make sure the window is not pruned.
        if FIXED:
            scores = F.pad(scores, (0, self.window_size), value=scores.max().item() + 1)
        else:
            scores = F.pad(scores, (0, self.window_size), value=scores.max().item())

        return scores


def generate_answer(model, question_ids, cache, context_length, max_new_tokens):
    position_ids = torch.arange(context_length, context_length + question_ids.shape[1]).unsqueeze(0)
    outputs = model(input_ids=question_ids, cache=cache, position_ids=position_ids, logits_to_keep=1)
    position_ids = position_ids[:, -1:] + 1
    generated_ids = [outputs.logits[0, -1].argmax()]
    last_logits = [outputs.logits[0, -1]]
    for i in range(max_new_tokens - 1):
        outputs = model(
            input_ids=generated_ids[-1].unsqueeze(0).unsqueeze(0),
            cache=cache,
            position_ids=position_ids + i,
        )
        generated_ids.append(outputs.logits[0, -1].argmax())
        last_logits.append(outputs.logits[0, -1])
    return torch.stack(generated_ids), torch.stack(last_logits)


def main():
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        attn_implementation="sdpa",
    )
    model = LlamaForCausalLM(config).eval()

    context_ids = torch.randint(3, config.vocab_size, (1, 32))
    question_ids = torch.randint(3, config.vocab_size, (1, 4))

    # keep a quarter of the 32 context keys: the observation window of 8
    press = SnapKVPress(compression_ratio=0.75, window_size=8, kernel_size=5)
    cache = DynamicCache(config=config)
    with torch.no_grad():
        with press(model):
            model.model(input_ids=context_ids, cache=cache, use_cache=True)
        kept = [layer.keys.shape[2] for layer in cache.layers]
        answer, logits = generate_answer(model, question_ids, cache, context_ids.shape[1], max_new_tokens=6)

    print("kept keys per layer:", kept)
    print("answer ids:", answer.tolist())
    print("answer logits sum:", round(logits.sum().item(), 4))


if __name__ == "__main__":
    main()
