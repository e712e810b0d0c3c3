# Correct program (quiet batch quiet-r120a).
#
# Ported from NVIDIA/kvpress @8bb29b9c3078452a86d692f29123fa6c793e2b05:
#   kvpress/presses/streaming_llm_press.py   StreamingLLMPress.score (n_sink sink tokens + the most recent ones)
#   kvpress/presses/key_rerotation_press.py  KeyRerotationPress (_rerotate_cos_sin, rerotate_keys, compress)
#   kvpress/presses/scorer_press.py          ScorerPress
#   kvpress/presses/base_press.py            is_prefilling, BasePress.forward_hook / __call__
#   kvpress/utils.py                         extract_keys_and_values (unquantized branch)
#   kvpress/pipeline.py                      KVPressTextGenerationPipeline._forward, generate_answer,
#                                            _remove_answer_from_cache
# StreamingLLM as the paper runs it (the StreamingLLMPress docstring points to KeyRerotationPress, issue #158):
# the context is prefilled once, its cache pruned to the 4 attention sinks plus the most recent tokens, the kept
# keys re-rotated to positions 0 .. n_kept - 1, and each question then answered greedily over that cache with
# position_ids continuing from the compressed length. The answer is cropped from the cache before the next question.
#
# Adapted to the installed transformers (5.x): the attention layer's hook kwargs carry `cache` (not
# `past_key_values`) and no `cache_position`, so is_prefilling reads the layer's cache length after the update;
# the model is a tiny LlamaForCausalLM built from its config (float64); generate_answer returns the token ids and
# step logits instead of decoding text with a tokenizer.
#
# Check: the same answers from a reference that rebuilds the compressed cache by hand (pre-RoPE keys of the kept
# tokens, rotated at their new positions) and feeds the question one token at a time.

import contextlib
import logging
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, PreTrainedModel
from transformers.cache_utils import Cache
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, rotate_half

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------- kvpress/utils.py
def extract_keys_and_values(cache: Cache, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
    keys = cache.layers[layer_idx].keys
    values = cache.layers[layer_idx].values
    return keys, values


# ---------------------------------------------------------------- kvpress/presses/base_press.py
def is_prefilling(cache: Cache, layer_idx: int, q_len: int) -> bool:
    """Return whether the current forward pass is the initial prefill."""
    # kvpress: cache_position[-1] + 1 == q_len (the hook runs after cache.update)
    return cache.get_seq_length(layer_idx) == q_len


@dataclass
class BasePress:
    def post_init_from_model(self, model: PreTrainedModel):
        pass

    def compress(self, module, hidden_states, keys, values, attentions, kwargs):
        raise NotImplementedError("compress method must be implemented in subclass")

    def forward_hook(self, module: nn.Module, input: list[torch.Tensor], kwargs: dict, output: list):
        hidden_states = kwargs["hidden_states"]
        cache = kwargs["cache"]
        cache_layer = cache.layers[module.layer_idx]
        q_len = hidden_states.shape[1]

        # Don't compress after pre-filling
        if not is_prefilling(cache, module.layer_idx, q_len):
            return output

        keys, values = extract_keys_and_values(cache, module.layer_idx)
        keys, values = self.compress(module, hidden_states, keys, values, output[1], kwargs)
        cache_layer.keys = keys
        cache_layer.values = values
        return output

    @contextmanager
    def __call__(self, model: PreTrainedModel):
        self.post_init_from_model(model)
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


# ---------------------------------------------------------------- kvpress/presses/scorer_press.py
@dataclass
class ScorerPress(BasePress):
    compression_ratio: float = 0.0

    def __post_init__(self):
        assert 0 <= self.compression_ratio < 1, "Compression ratio must be between 0 and 1"

    def score(self, module, hidden_states, keys, values, attentions, kwargs) -> torch.Tensor:
        raise NotImplementedError

    def compress(self, module, hidden_states, keys, values, attentions, kwargs):
        if self.compression_ratio == 0:
            return keys, values
        scores = self.score(module, hidden_states, keys, values, attentions, kwargs)
        k_len = keys.shape[2]
        n_kept = int(k_len * (1 - self.compression_ratio))
        indices = scores.topk(n_kept, dim=-1).indices
        indices = indices.unsqueeze(-1).expand(-1, -1, -1, module.head_dim)
        keys = keys.gather(2, indices).contiguous()
        values = values.gather(2, indices).contiguous()
        return keys, values


# ---------------------------------------------------------------- kvpress/presses/streaming_llm_press.py
@dataclass
class StreamingLLMPress(ScorerPress):
    compression_ratio: float = 0.0
    n_sink: int = 4

    def score(self, module, hidden_states, keys, values, attentions, kwargs) -> torch.Tensor:
        k_len = keys.shape[2]
        assert k_len > self.n_sink, f"Input should contain more tokens than n_sink={self.n_sink}"
        n_pruned = k_len - int(k_len * (1 - self.compression_ratio))
        scores = torch.ones_like(keys[..., 0])
        scores[:, :, self.n_sink : self.n_sink + n_pruned] = 0
        return scores


# ---------------------------------------------------------------- kvpress/presses/key_rerotation_press.py
@dataclass
class KeyRerotationPress(BasePress):
    press: ScorerPress

    def __post_init__(self):
        assert isinstance(self.press, ScorerPress)

    def post_init_from_model(self, model):
        self.press.post_init_from_model(model)

    @property
    def compression_ratio(self):
        return self.press.compression_ratio

    @compression_ratio.setter
    def compression_ratio(self, value):
        self.press.compression_ratio = value

    @staticmethod
    def _rerotate_cos_sin(x, inv_freq, selected_positions):
        bsz, num_key_value_heads, n_kept = selected_positions.shape
        device = x.device
        device_type = x.device.type
        dtype = x.dtype
        selected_positions = selected_positions.to(device)
        inv_freq = inv_freq.to(device)
        # Original positional indices
        idx = torch.arange(0, n_kept, device=device)  # (n_kept,)
        idx = idx.unsqueeze(0)  # (1, n_kept)
        inv_freq = inv_freq[None, None, :, None].float().expand(bsz, num_key_value_heads, -1, 1)
        idx = idx[:, None, :].float().expand(bsz, num_key_value_heads, n_kept)
        # Compute delta between original and selected positions
        delta_pos = idx - selected_positions  # (bsz, num_key_value_heads, n_kept)
        delta_pos = delta_pos.unsqueeze(2)  # (bsz, num_key_value_heads, 1, n_kept)

        device_type = device_type if isinstance(device_type, str) and device_type != "mps" else "cpu"
        with torch.autocast(device_type=device_type, enabled=False):
            # Compute the new freq by scaling inv_freq by delta
            freqs = delta_pos.float() * inv_freq.float()  # (bsz, num_key_value_heads, d//2, n_kept)
            freqs = freqs.transpose(2, 3)  # (bsz, num_key_value_heads, n_kept, d//2)
            emb = torch.cat((freqs, freqs), dim=-1)
            # Compute cosine and sine required to re-rotate keys to selected positions
            cos = emb.cos().contiguous()
            sin = emb.sin().contiguous()
        return cos.to(dtype=dtype), sin.to(dtype=dtype)

    @staticmethod
    def rerotate_keys(module: nn.Module, indices: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        new_cos, new_sin = KeyRerotationPress._rerotate_cos_sin(keys, module.rotary_emb.inv_freq, indices)
        indices = indices.unsqueeze(-1).expand(-1, -1, -1, module.head_dim)
        keys = keys.gather(2, indices).contiguous()
        return (keys * new_cos) + (rotate_half(keys) * new_sin)

    def compress(self, module, hidden_states, keys, values, attentions, kwargs):
        if self.press.compression_ratio == 0:
            return keys, values

        # Compute scores from base press
        scores = self.press.score(module, hidden_states, keys, values, attentions, kwargs)

        # Get indices of KV pairs with the lowest scores
        q_len = keys.shape[2]
        n_kept = int(q_len * (1 - self.press.compression_ratio))
        indices = scores.topk(n_kept, dim=-1).indices
        indices = torch.sort(indices, dim=2).values
        keys = self.rerotate_keys(module, indices, keys)
        indices = indices.unsqueeze(-1).expand(-1, -1, -1, module.head_dim)
        values = values.gather(2, indices).contiguous()
        return keys, values


# ---------------------------------------------------------------- kvpress/pipeline.py
class KVPressTextGenerationPipeline:
    def __init__(self, model, eos_token_id):
        self.model = model
        self.eos_token_id = eos_token_id

    def _forward(self, input_tensors, max_new_tokens=50, press=None, cache=None):
        context_ids = input_tensors["context_ids"].to(self.model.device)
        context_length = context_ids.shape[1]

        # Prefilling using the press on the context
        if cache is None:
            cache = DynamicCache()

        with press(self.model) if press is not None else contextlib.nullcontext():
            # We run the model without the lm head for pre-filling.
            self.model.model(input_ids=context_ids, cache=cache)

        logger.debug(f"Context Length: {context_length}")
        logger.debug(f"Compressed Context Length: {cache.get_seq_length()}")

        answers = []
        for question_ids in input_tensors["questions_ids"]:
            if isinstance(press, KeyRerotationPress):
                context_length = cache.get_seq_length()

            cache_seq_lengths = [cache.get_seq_length(layer_idx) for layer_idx in range(len(cache))]
            answer = self.generate_answer(
                question_ids=question_ids.to(self.model.device),
                cache=cache,
                context_length=context_length,
                max_new_tokens=max_new_tokens,
            )
            self._remove_answer_from_cache(cache, cache_seq_lengths)
            answers.append(answer)
        return answers, cache

    def _remove_answer_from_cache(self, cache: Cache, cache_seq_lengths: list[int]):
        for layer_idx, sequence_length in enumerate(cache_seq_lengths):
            cache.layers[layer_idx].keys = cache.layers[layer_idx].keys[:, :, :sequence_length]
            cache.layers[layer_idx].values = cache.layers[layer_idx].values[:, :, :sequence_length]

    def generate_answer(self, question_ids, cache, context_length, max_new_tokens):
        position_ids = torch.arange(
            context_length, context_length + question_ids.shape[1], device=self.model.device
        ).unsqueeze(0)

        outputs = self.model(
            input_ids=question_ids.to(self.model.device),
            cache=cache,
            position_ids=position_ids,
            logits_to_keep=1,
        )
        position_ids = position_ids[:, -1:] + 1
        generated_ids = [outputs.logits[0, -1].argmax()]
        step_logits = [outputs.logits[0, -1]]

        should_stop_token_ids = [self.eos_token_id]
        for i in range(max_new_tokens - 1):
            outputs = self.model(
                input_ids=generated_ids[-1].unsqueeze(0).unsqueeze(0),
                cache=cache,
                position_ids=position_ids + i,
            )
            new_id = outputs.logits[0, -1].argmax()
            generated_ids.append(new_id)
            step_logits.append(outputs.logits[0, -1])
            if new_id.item() in should_stop_token_ids:
                break
        return torch.stack(generated_ids), torch.stack(step_logits)


# ---------------------------------------------------------------- reference
@torch.no_grad()
def reference_answers(model, context_ids, questions_ids, kept, max_new_tokens, eos_token_id):
    """Rebuild the compressed cache from pre-RoPE keys, then answer one token at a time."""
    raw = {}
    handles = []
    for layer in model.model.layers:
        attn = layer.self_attn

        def grab(name, idx):
            def hook(mod, inp, out):
                raw[(name, idx)] = out

            return hook

        handles.append(attn.k_proj.register_forward_hook(grab("k", attn.layer_idx)))
        handles.append(attn.v_proj.register_forward_hook(grab("v", attn.layer_idx)))
    model.model(input_ids=context_ids)  # no cache: the full context, causal
    for h in handles:
        h.remove()

    cfg = model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    n_kept = len(kept)
    new_pos = torch.arange(n_kept)[None]
    dummy = torch.zeros(1, n_kept, cfg.hidden_size, dtype=model.dtype)
    cos, sin = model.model.rotary_emb(dummy, new_pos)

    answers = []
    for question_ids in questions_ids:
        cache = DynamicCache()
        for li in range(cfg.num_hidden_layers):
            k = raw[("k", li)][:, kept].view(1, n_kept, -1, head_dim).transpose(1, 2)
            v = raw[("v", li)][:, kept].view(1, n_kept, -1, head_dim).transpose(1, 2)
            _, k = apply_rotary_pos_emb(k, k, cos, sin)
            cache.update(k, v, li)

        pos = n_kept
        logits = None
        for t in question_ids[0]:
            logits = model(input_ids=t.view(1, 1), cache=cache, position_ids=torch.tensor([[pos]])).logits[0, -1]
            pos += 1
        ids, step_logits = [logits.argmax()], [logits]
        for _ in range(max_new_tokens - 1):
            logits = model(input_ids=ids[-1].view(1, 1), cache=cache, position_ids=torch.tensor([[pos]])).logits[0, -1]
            pos += 1
            ids.append(logits.argmax())
            step_logits.append(logits)
            if ids[-1].item() == eos_token_id:
                break
        answers.append((torch.stack(ids), torch.stack(step_logits)))
    return answers


def main():
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rope_theta=10000.0,
        eos_token_id=1,
    )
    model = LlamaForCausalLM(config).to(torch.float64).eval()

    context_ids = torch.randint(2, config.vocab_size, (1, 61))
    questions_ids = [torch.randint(2, config.vocab_size, (1, n)) for n in (5, 3)]
    max_new_tokens = 12

    press = KeyRerotationPress(press=StreamingLLMPress(compression_ratio=0.6, n_sink=4))
    pipe = KVPressTextGenerationPipeline(model, eos_token_id=config.eos_token_id)
    with torch.no_grad():
        answers, cache = pipe._forward(
            {"context_ids": context_ids, "questions_ids": questions_ids}, max_new_tokens=max_new_tokens, press=press
        )

    L = context_ids.shape[1]
    n_kept = int(L * (1 - press.compression_ratio))
    kept = list(range(press.press.n_sink)) + list(range(L - (n_kept - press.press.n_sink), L))
    assert cache.get_seq_length() == n_kept, (cache.get_seq_length(), n_kept)

    ref = reference_answers(model, context_ids, questions_ids, kept, max_new_tokens, config.eos_token_id)
    for qi, ((ids, logits), (ref_ids, ref_logits)) in enumerate(zip(answers, ref)):
        assert torch.equal(ids, ref_ids), (qi, ids.tolist(), ref_ids.tolist())
        err = (logits - ref_logits).abs().max().item()
        print(f"question {qi}: answer {ids.tolist()}  max |logit - reference| = {err:.2e}")
        assert err < 1e-6, err  # the rerotation's cos / sin are computed in float32, as kvpress does
    print(f"context {L} tokens -> {n_kept} kept (sinks {kept[:4]}, recent {kept[4]}..{kept[-1]}); ok")


if __name__ == "__main__":
    main()
