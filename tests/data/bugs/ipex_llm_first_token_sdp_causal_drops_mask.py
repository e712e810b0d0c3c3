"""IPEX-LLM optimized Qwen2 attention: the first-token sdp_causal kernel called without attention_mask.

Citation: intel/ipex-llm#11153 (commit d307622797), "fix first token sdp with batch". IPEX-LLM
replaces the Hugging Face attention forward of each model (qwen2.py, phi3.py, baichuan2.py,
internlm.py, ...) with its own; for the first token (`use_sdp_causal(q_len, kv_seq_len, ...)`,
q_len > 1) it called `xe_addons.sdp_causal(query_states, key_states, value_states)`, a plain
causal kernel, while the decode path (`use_sdp`, q_len == 1) already passed `attention_mask`.
A batch with left padding therefore had its pad tokens attended during prefill. The fix passes
`attention_mask` to `sdp_causal` ("if bsz > 1, it will compute attention according to
attention_mask").

This program: `xe_addons` is the Intel XPU extension, unavailable here, so a stand-in namespace
implements its two kernels with F.scaled_dot_product_attention (is_causal when no mask is given,
the mask otherwise). The model keeps the HF Qwen2 shape: a 2-D attention_mask turned into a 4-D
additive causal mask by `_prepare_4d_causal_attention_mask`, a per-layer KV cache, the optimized
`qwen2_attention_forward` choosing `use_sdp` / `use_sdp_causal` by q_len. A batch of two
left-padded prompts (3 pads on row 0) is prefilled, then decoded for two steps.
"""
import sys
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


def _sdp(query, key, value, mask):
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask)


def _sdp_causal(query, key, value, mask=None):
    if mask is None:
        return F.scaled_dot_product_attention(query, key, value, is_causal=True)
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask)


xe_addons = SimpleNamespace(sdp=_sdp, sdp_causal=_sdp_causal)


def use_sdp(q_len, kv_len, head_dim, query_states):
    return q_len == 1 and head_dim % 8 == 0


def use_sdp_causal(q_len, kv_len, head_dim, query_states, training):
    return q_len > 1 and q_len == kv_len and not training and head_dim % 8 == 0


def _prepare_4d_causal_attention_mask(attention_mask, input_shape, inputs_embeds, past_key_values_length):
    bsz, tgt_len = input_shape
    src_len = past_key_values_length + tgt_len
    dtype = inputs_embeds.dtype
    min_val = torch.finfo(dtype).min
    q_pos = torch.arange(past_key_values_length, src_len)[:, None]
    k_pos = torch.arange(src_len)[None, :]
    causal = torch.where(k_pos <= q_pos, 0.0, min_val).to(dtype)[None, None].expand(bsz, 1, tgt_len, src_len)
    padding = (1.0 - attention_mask[:, None, None, :].to(dtype)) * min_val
    return (causal + padding).clamp(min=min_val)


class Qwen2Config(SimpleNamespace):
    pass


class Qwen2Attention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.q_proj = nn.Linear(config.hidden_size, config.hidden_size)
        self.k_proj = nn.Linear(config.hidden_size, config.hidden_size)
        self.v_proj = nn.Linear(config.hidden_size, config.hidden_size)
        self.o_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)


def qwen2_attention_forward(self, hidden_states, attention_mask, past_key_value):
    bsz, q_len, _ = hidden_states.shape
    query_states = self.q_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
    key_states = self.k_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
    value_states = self.v_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
    if past_key_value is not None:
        key_states = torch.cat([past_key_value[0], key_states], dim=2)
        value_states = torch.cat([past_key_value[1], value_states], dim=2)
    present = (key_states, value_states)
    kv_seq_len = key_states.shape[2]

    if use_sdp(q_len, kv_seq_len, self.head_dim, query_states):
        attn_output = xe_addons.sdp(query_states, key_states, value_states, attention_mask)
    elif use_sdp_causal(q_len, kv_seq_len, self.head_dim, query_states, self.training):
        if FIXED:
            attn_output = xe_addons.sdp_causal(query_states, key_states, value_states, attention_mask)
        else:
            attn_output = xe_addons.sdp_causal(query_states, key_states, value_states)
    else:
        attn_weights = query_states @ key_states.transpose(2, 3) / self.head_dim ** 0.5
        attn_weights = attn_weights + attention_mask
        attn_output = torch.softmax(attn_weights, dim=-1) @ value_states
    attn_output = attn_output.transpose(1, 2).reshape(bsz, q_len, -1)
    return self.o_proj(attn_output), present


class Qwen2ForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Qwen2Attention(config) for _ in range(config.num_hidden_layers))
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids, attention_mask, past_key_values=None):
        past_len = past_key_values[0][0].shape[2] if past_key_values else 0
        h = self.embed_tokens(input_ids)
        mask4d = _prepare_4d_causal_attention_mask(attention_mask, input_ids.shape, h, past_len)
        presents = []
        for i, layer in enumerate(self.layers):
            out, present = qwen2_attention_forward(layer, h, mask4d, past_key_values[i] if past_key_values else None)
            h = h + out
            presents.append(present)
        return self.lm_head(h), presents


def main():
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=64, hidden_size=32, num_attention_heads=4, num_hidden_layers=2,
                         pad_token_id=0)
    model = Qwen2ForCausalLM(config).eval()
    input_ids = torch.tensor([[0, 0, 0, 17, 5, 40], [9, 33, 2, 21, 8, 50]])
    attention_mask = torch.tensor([[0, 0, 0, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    with torch.no_grad():
        logits, cache = model(input_ids, attention_mask)
        tokens = [logits[:, -1].argmax(-1).tolist()]
        nxt = logits[:, -1:].argmax(-1)
        for _ in range(2):
            attention_mask = torch.cat([attention_mask, torch.ones(2, 1, dtype=torch.long)], dim=1)
            logits, cache = model(nxt, attention_mask, cache)
            nxt = logits[:, -1:].argmax(-1)
            tokens.append(nxt[:, 0].tolist())
    print("fixed" if FIXED else "buggy", "generated per step", tokens)


if __name__ == "__main__":
    main()
