"""AWQ fused attention under transformers: the SDPA path hands the fused module attention_mask=None.

Citation: huggingface/transformers#30317, "FIX: Fixes unexpected behaviour for Llava / LLama & AWQ
Fused modules + revert #30070 at the same time" (merged). With `AwqConfig(do_fuse=True)`,
transformers/integrations/awq.py swaps each Llama attention for AutoAWQ's `QuantAttentionFused`,
but the model around it still builds its mask for the configured `_attn_implementation`. For
"sdpa", `LlamaModel._update_causal_mask` returns None when `_ignore_causal_mask_sdpa` says the
kernel's `is_causal` can do the job (no padding). `QuantAttentionFused.forward` is not SDPA: it
adds the mask only `if attention_mask is not None and seqlen > 1`, so with None the prompt is
processed with no causal mask at all ("passing a None attention mask results in unexpected
behaviour for awq fused modules"). The fix sets `module.config._attn_implementation = "custom"`
on the parent modules of fused attention, so the model builds the explicit 4-D causal mask.

This program: a Llama-style model in plain torch whose `_update_causal_mask` follows the v4.40
logic, the fused attention module written after AutoAWQ's (qkv_proj, a preallocated KV cache,
scores + mask sliced to seqlen, softmax; rotary omitted), and the fusing step from
integrations/awq.py. One unpadded prompt of 6 tokens is prefilled (the argmax at every position is printed, as a
scoring pass would read them), then two tokens decoded.
"""
import math
import sys
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


@dataclass
class LlamaConfig:
    vocab_size: int = 64
    hidden_size: int = 32
    num_attention_heads: int = 4
    num_hidden_layers: int = 2
    max_position_embeddings: int = 64
    _attn_implementation: str = "sdpa"


@dataclass
class AwqConfig:
    bits: int = 4
    do_fuse: bool = True
    fuse_max_seq_len: int = 32


class LlamaSdpaAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_heads, self.head_dim = config.num_attention_heads, config.hidden_size // config.num_attention_heads
        self.q_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.o_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)


class QuantAttentionFused(nn.Module):
    def __init__(self, hidden_size, n_heads, qkv_layer, o_proj, max_seq_len):
        super().__init__()
        self.n_heads, self.head_dim = n_heads, hidden_size // n_heads
        self.qkv_proj, self.o_proj = qkv_layer, o_proj
        self.max_seq_len = max_seq_len
        self.start_pos = 0
        self.cache_k = self.cache_v = None

    def forward(self, hidden_states, attention_mask=None, *args, **kwargs):
        bsz, seqlen, _ = hidden_states.shape
        if kwargs.get("past_key_value") is None and seqlen > 1:
            self.start_pos = 0
            self.cache_k = torch.zeros(bsz, self.n_heads, self.max_seq_len, self.head_dim)
            self.cache_v = torch.zeros(bsz, self.n_heads, self.max_seq_len, self.head_dim)
        xqkv = self.qkv_proj(hidden_states).view(bsz, seqlen, 3, self.n_heads, self.head_dim)
        xq, xk, xv = (t.transpose(1, 2) for t in xqkv.unbind(2))
        self.cache_k[:, :, self.start_pos : self.start_pos + seqlen] = xk
        self.cache_v[:, :, self.start_pos : self.start_pos + seqlen] = xv
        if seqlen == 1:
            keys = self.cache_k[:, :, : self.start_pos + seqlen]
            values = self.cache_v[:, :, : self.start_pos + seqlen]
        else:
            keys, values = xk, xv
        scores = torch.matmul(xq, keys.transpose(2, 3)) / math.sqrt(self.head_dim)
        # When seqlen is 1, there is nothing else to attend to
        if attention_mask is not None and seqlen > 1:
            if attention_mask.shape[-1] != seqlen:
                attention_mask = attention_mask[:, :, :seqlen, :seqlen]
            scores = scores + attention_mask
        scores = F.softmax(scores.float(), dim=-1).type_as(xq)
        output = torch.matmul(scores, values).transpose(1, 2).contiguous().view(bsz, seqlen, -1)
        self.start_pos += seqlen
        return self.o_proj(output), None, [torch.zeros(1)]


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.self_attn = LlamaSdpaAttention(config)
        self.mlp = nn.Sequential(nn.Linear(config.hidden_size, 64), nn.SiLU(), nn.Linear(64, config.hidden_size))

    def forward(self, hidden_states, attention_mask, past_key_value):
        attn_out, _, _ = self.self_attn(hidden_states, attention_mask, past_key_value=past_key_value)
        hidden_states = hidden_states + attn_out
        return hidden_states + self.mlp(hidden_states)


def _ignore_causal_mask_sdpa(attention_mask, inputs_embeds, past_key_values_length):
    _, query_length = inputs_embeds.shape[:2]
    key_value_length = query_length + past_key_values_length
    if attention_mask is None:
        return query_length == 1 or key_value_length == query_length
    return bool(torch.all(attention_mask == 1)) and (query_length == 1 or key_value_length == query_length)


class LlamaModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config) for _ in range(config.num_hidden_layers))

    def _update_causal_mask(self, attention_mask, input_tensor, past_seen_tokens):
        if self.config._attn_implementation == "flash_attention_2":
            return attention_mask if attention_mask is not None and 0.0 in attention_mask else None
        if self.config._attn_implementation == "sdpa":
            # For SDPA, when possible, rely on its `is_causal` argument instead of its `attn_mask`.
            if _ignore_causal_mask_sdpa(attention_mask, input_tensor, past_seen_tokens):
                return None
        dtype = input_tensor.dtype
        min_dtype = torch.finfo(dtype).min
        seq_len = input_tensor.shape[1]
        target_length = past_seen_tokens + seq_len
        causal_mask = torch.full((seq_len, target_length), min_dtype, dtype=dtype)
        causal_mask = torch.triu(causal_mask, diagonal=past_seen_tokens + 1)
        causal_mask = causal_mask[None, None].expand(input_tensor.shape[0], 1, -1, -1).clone()
        if attention_mask is not None:
            padding = attention_mask[:, None, None, :].eq(0)
            causal_mask = causal_mask.masked_fill(padding, min_dtype)
        return causal_mask

    def forward(self, input_ids, attention_mask=None, past_seen_tokens=0, past_key_values=None):
        h = self.embed_tokens(input_ids)
        causal_mask = self._update_causal_mask(attention_mask, h, past_seen_tokens)
        for layer in self.layers:
            h = layer(h, causal_mask, past_key_values)
        return h


class LlamaForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids, attention_mask=None, past_seen_tokens=0, past_key_values=None):
        return self.lm_head(self.model(input_ids, attention_mask, past_seen_tokens, past_key_values))


def fuse_awq_modules(model, quantization_config):
    fused_attention_modules = []
    for name, module in model.named_modules():
        if isinstance(module, LlamaSdpaAttention):
            qkv = nn.Linear(module.q_proj.in_features, 3 * module.q_proj.out_features, bias=False)
            with torch.no_grad():
                qkv.weight.copy_(torch.cat([module.q_proj.weight, module.k_proj.weight, module.v_proj.weight]))
            fused = QuantAttentionFused(model.config.hidden_size, model.config.num_attention_heads, qkv,
                                        module.o_proj, quantization_config.fuse_max_seq_len)
            parent_name, child = name.rsplit(".", 1)
            setattr(model.get_submodule(parent_name), child, fused)
            fused_attention_modules.append(name)
    if FIXED and len(fused_attention_modules) > 0:
        # The fused modules need an explicit mask: no mask-skipping optimisation of sdpa / FA2.
        parents = {n.split(".")[0] for n in fused_attention_modules}
        for module_name, module in model.named_modules():
            if any(module_name in p for p in parents):
                if hasattr(module, "config") and hasattr(module.config, "_attn_implementation"):
                    module.config._attn_implementation = "custom"
    return model


def main():
    torch.manual_seed(0)
    config = LlamaConfig()
    model = fuse_awq_modules(LlamaForCausalLM(config).eval(), AwqConfig())
    input_ids = torch.tensor([[5, 23, 11, 40, 2, 17]])
    attention_mask = torch.ones_like(input_ids)
    with torch.no_grad():
        logits = model(input_ids, attention_mask)
        per_position = logits[0].argmax(-1).tolist()
        out = [per_position[-1]]
        seen = input_ids.shape[1]
        for _ in range(2):
            attention_mask = torch.cat([attention_mask, torch.ones(1, 1, dtype=torch.long)], dim=1)
            logits = model(torch.tensor([[out[-1]]]), attention_mask, seen, past_key_values=[torch.zeros(1)])
            seen += 1
            out.append(logits[0, -1].argmax().item())
    print("fixed" if FIXED else "buggy", "attn_implementation", config._attn_implementation)
    print("prefill next-token argmax per position", per_position, "generated", out)


if __name__ == "__main__":
    main()
