"""Baichuan-13B (trust_remote_code modeling_baichuan.py): BaichuanModel ignores attention_mask.

Citation: baichuan-inc/Baichuan-13B issue #79 "关于 forward attention_mask 参数"
(`BaichuanModel.forward` does not support attention_mask -- does it affect batches of
prompts of different lengths?), pointing at Hub commit 43fb20e1 of
Baichuan-13B-Base/modeling_baichuan.py; maintainer (GradientGuru): "已经更新，请在hugging
face pull 最新代码" (updated, pull the latest code from the Hub).

Bug: `BaichuanModel.forward` took `attention_mask` but built the per-layer additive mask
from `get_alibi_mask(inputs_embeds, seq_length_with_past)` alone (ALiBi bias + causal
-inf), so in a left-padded batch (the Baichuan tokenizer pads left for generation) the
real tokens attended to the pad tokens in front of them.
Fix (the updated Hub file, read in stored copies): when `attention_mask` is 2-D, expand it
to `tril(gt(m_i * m_j, 0)) * eq(m_i - m_j, 0)`, invert it to finfo.min and add the ALiBi
mask: `attention_mask = inverted_mask + alibi_mask.unsqueeze(0)`.

Reproduction: one BaichuanLayer (eager softmax over q @ k^T + mask) behind
BaichuanModel.forward, eval mode, a batch of two prompts, the second left-padded by 3.
The pre-fix forward is reconstructed from the issue (the mask passed down is the ALiBi
mask itself); the fixed branch follows the updated file.
"""
import math
import sys
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv


@dataclass
class BaichuanConfig:
    vocab_size: int = 64
    hidden_size: int = 32
    intermediate_size: int = 64
    num_hidden_layers: int = 1
    num_attention_heads: int = 4
    model_max_length: int = 16
    pad_token_id: int = 0
    rms_norm_eps: float = 1e-6


def _get_interleave(n):
    def _get_interleave_power_of_2(n):
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        ratio = start
        return [start * ratio ** i for i in range(n)]

    if math.log2(n).is_integer():
        return _get_interleave_power_of_2(n)
    closest_power_of_2 = 2 ** math.floor(math.log2(n))
    return _get_interleave_power_of_2(closest_power_of_2) + \
        _get_interleave(2 * closest_power_of_2)[0::2][:n - closest_power_of_2]


def _fill_with_neg_inf(t):
    """FP16-compatible function that fills a tensor with -inf."""
    return t.float().fill_(float("-inf")).type_as(t)


def _gen_alibi_mask(n_head, max_pos):
    """used in inference only"""
    slopes = torch.Tensor(_get_interleave(n_head))
    alibi = slopes.unsqueeze(1).unsqueeze(1) * torch.arange(max_pos).unsqueeze(0).unsqueeze(0).expand(
        n_head, -1, -1)
    alibi = alibi.view(n_head, 1, max_pos)
    alibi_mask = torch.triu(
        _fill_with_neg_inf(torch.zeros([max_pos, max_pos])), 1
    )
    alibi_mask = alibi_mask.unsqueeze(0) + alibi
    return alibi_mask


class BaichuanAttention(nn.Module):
    def __init__(self, config: BaichuanConfig):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = self.hidden_size // self.num_heads
        self.W_pack = nn.Linear(self.hidden_size, 3 * self.hidden_size, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, self.hidden_size, bias=False)

    def forward(self, hidden_states, attention_mask=None):
        bsz, q_len, _ = hidden_states.size()
        proj = self.W_pack(hidden_states)
        proj = proj.unflatten(-1, (3, self.hidden_size)).unsqueeze(0).transpose(0, -2).squeeze(-2)
        query_states = proj[0].view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        key_states = proj[1].view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        value_states = proj[2].view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)

        attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) / math.sqrt(self.head_dim)
        if attention_mask is not None:
            if q_len == 1:  # inference with cache
                if len(attention_mask.size()) == 4:
                    attention_mask = attention_mask[:, :, -1:, :]
                else:
                    attention_mask = attention_mask[:, -1:, :]
            attn_weights = attn_weights + attention_mask
            attn_weights = torch.max(attn_weights, torch.tensor(torch.finfo(attn_weights.dtype).min))
        attn_weights = torch.nn.functional.softmax(attn_weights, dim=-1)
        attn_output = torch.matmul(attn_weights, value_states)
        attn_output = attn_output.transpose(1, 2).reshape(bsz, q_len, self.hidden_size)
        return self.o_proj(attn_output)


class BaichuanLayer(nn.Module):
    def __init__(self, config: BaichuanConfig):
        super().__init__()
        self.self_attn = BaichuanAttention(config)
        self.input_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, attention_mask=None):
        residual = hidden_states
        hidden_states = self.self_attn(self.input_layernorm(hidden_states), attention_mask=attention_mask)
        return residual + hidden_states


class BaichuanModel(nn.Module):
    def __init__(self, config: BaichuanConfig):
        super().__init__()
        self.padding_idx = config.pad_token_id
        self.n_head = config.num_attention_heads
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList([BaichuanLayer(config) for _ in range(config.num_hidden_layers)])
        self.norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.max_cache_pos = config.model_max_length
        self.first_run = True
        self.alibi_mask = None

    def get_alibi_mask(self, tensor, seq_length_with_past):
        if self.first_run:
            self.first_run = False
            self.register_buffer("future_mask", _gen_alibi_mask(self.n_head, self.max_cache_pos).to(tensor),
                                 persistent=False)
        mask = self.future_mask[:self.n_head, :seq_length_with_past, :seq_length_with_past]
        return mask

    def forward(self, input_ids: torch.LongTensor, attention_mask: Optional[torch.Tensor] = None):
        batch_size, seq_length = input_ids.shape
        seq_length_with_past = seq_length
        inputs_embeds = self.embed_tokens(input_ids)
        alibi_mask = self.get_alibi_mask(inputs_embeds, seq_length_with_past)

        if FIXED and attention_mask is not None:
            if len(attention_mask.shape) == 2:
                expanded_mask = attention_mask.to(alibi_mask.dtype)
                expanded_mask = torch.tril(torch.gt(expanded_mask[:, :, None] * expanded_mask[:, None, :], 0)
                                           ) * torch.eq(expanded_mask[:, :, None] - expanded_mask[:, None, :], 0)
            else:
                expanded_mask = attention_mask
            bsz = inputs_embeds.size(0)
            src_len, tgt_len = alibi_mask.size()[-2:]
            expanded_mask = expanded_mask.unsqueeze(1).expand(bsz, 1, src_len, tgt_len).to(alibi_mask.dtype)
            inverted_mask = 1.0 - expanded_mask
            inverted_mask = inverted_mask.masked_fill(inverted_mask.to(torch.bool),
                                                      torch.finfo(alibi_mask.dtype).min)
            attention_mask = inverted_mask + alibi_mask.unsqueeze(0)
        else:
            attention_mask = alibi_mask

        hidden_states = inputs_embeds
        for decoder_layer in self.layers:
            hidden_states = decoder_layer(hidden_states, attention_mask=attention_mask)
        return self.norm(hidden_states)


def main():
    torch.manual_seed(0)
    config = BaichuanConfig()
    model = BaichuanModel(config).eval()
    pad = config.pad_token_id
    # left padding, as Baichuan's tokenizer does for batched generation
    input_ids = torch.tensor([[5, 9, 13, 7, 22, 31, 8, 4],
                              [pad, pad, pad, 11, 6, 17, 25, 3]])
    attention_mask = (input_ids != pad).long()
    with torch.no_grad():
        out = model(input_ids, attention_mask=attention_mask)
        alone = model(input_ids[1:, 3:], attention_mask=attention_mask[1:, 3:])
    # ALiBi is relative, so the unpadded prompt alone must match its padded row
    diff = (out[1, 3:] - alone[0]).abs().max().item()
    print("fixed" if FIXED else "buggy", "left-padded row vs alone max diff:", f"{diff:.2e}")


if __name__ == "__main__":
    main()
