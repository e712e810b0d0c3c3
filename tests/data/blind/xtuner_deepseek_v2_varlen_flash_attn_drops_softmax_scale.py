# InternLM/xtuner#873 (commit 01640b0, "[Bug] fix dsv2 attn dispatch (softmax_scale)").
#
# xtuner trains DeepSeek-V2 on packed sequences by dispatching DeepseekV2Attention.forward to
# deepseek_varlen_attn_forward (xtuner/model/modules/dispatch/deepseek_v2.py), which calls the
# flash-attn wrappers in xtuner/model/modules/dispatch/attention.py. DeepSeek-V2's attention
# scale is not 1/sqrt(head_dim): with YaRN rope scaling it is q_head_dim ** -0.5 * mscale ** 2
# (self.softmax_scale). Before the fix, varlen_flash_attn (and flash_attn_w_mask) had no
# softmax_scale argument and the dispatch did not pass one, so flash_attn_varlen_func used its
# default 1/sqrt(q_head_dim) for every packed training step.
# The fix adds softmax_scale to the wrappers and passes softmax_scale=self.softmax_scale.
#
# flash_attn_varlen_func is replaced by a plain-torch stand-in with the same arguments
# (cu_seqlens_q / cu_seqlens_k, max_seqlen, softmax_scale=None -> 1/sqrt(d), causal,
# window_size) so the program runs on CPU.
import math
import sys
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


# ---- stand-in for flash_attn.flash_attn_varlen_func ------------------------------------------
def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           dropout_p=0.0, softmax_scale=None, causal=False,
                           window_size=(-1, -1), return_attn_probs=False):
    if softmax_scale is None:
        softmax_scale = q.shape[-1] ** (-0.5)
    out = torch.empty_like(q)
    for i in range(cu_seqlens_q.numel() - 1):
        qs, qe = int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1])
        ks, ke = int(cu_seqlens_k[i]), int(cu_seqlens_k[i + 1])
        qi = q[qs:qe].transpose(0, 1)  # nhead, s, d
        ki = k[ks:ke].transpose(0, 1)
        vi = v[ks:ke].transpose(0, 1)
        scores = torch.matmul(qi, ki.transpose(-1, -2)) * softmax_scale
        sq, sk = qe - qs, ke - ks
        row = torch.arange(sq)[:, None] + (sk - sq)
        col = torch.arange(sk)[None, :]
        keep = torch.ones(sq, sk, dtype=torch.bool)
        if causal:
            keep &= col <= row
        if window_size[0] >= 0:
            keep &= col >= row - window_size[0]
        if window_size[1] >= 0:
            keep &= col <= row + window_size[1]
        scores = scores.masked_fill(~keep, float("-inf"))
        probs = scores.softmax(-1)
        out[qs:qe] = torch.matmul(probs, vi).transpose(0, 1)
    return out


# ---- xtuner/model/modules/dispatch/attention.py -----------------------------------------------
if FIXED:
    def varlen_flash_attn(
            query_states,
            key_states,
            value_states,
            cumulative_len,
            max_seqlen,
            softmax_scale=None,
            dropout_p=0.,
            causal=True,
            window_size=(-1, -1),  # -1 means infinite context window
    ):
        q_unpad, k_unpad, v_unpad = query_states.flatten(0, 1), key_states.flatten(
            0, 1), value_states.flatten(0, 1)
        attn_output = flash_attn_varlen_func(
            q_unpad,
            k_unpad,
            v_unpad,
            cumulative_len,
            cumulative_len,
            max_seqlen,
            max_seqlen,
            softmax_scale=softmax_scale,
            dropout_p=dropout_p,
            return_attn_probs=False,
            causal=causal,
            window_size=window_size)
        attn_output = attn_output.unsqueeze(0)
        return attn_output
else:
    def varlen_flash_attn(
            query_states,
            key_states,
            value_states,
            cumulative_len,
            max_seqlen,
            dropout_p=0.,
            causal=True,
            window_size=(-1, -1),  # -1 means infinite context window
    ):
        q_unpad, k_unpad, v_unpad = query_states.flatten(0, 1), key_states.flatten(
            0, 1), value_states.flatten(0, 1)
        attn_output = flash_attn_varlen_func(
            q_unpad,
            k_unpad,
            v_unpad,
            cumulative_len,
            cumulative_len,
            max_seqlen,
            max_seqlen,
            dropout_p=dropout_p,
            return_attn_probs=False,
            causal=causal,
            window_size=window_size)
        attn_output = attn_output.unsqueeze(0)
        return attn_output


# ---- DeepSeek-V2 modeling pieces (modeling_deepseek.py) ---------------------------------------
def yarn_get_mscale(scale=1, mscale=1):
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


class DeepseekV2RMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states


class DeepseekV2RotaryEmbedding(nn.Module):
    def __init__(self, dim, base=10000):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x, seq_len=None):
        t = torch.arange(int(seq_len), dtype=self.inv_freq.dtype)
        freqs = torch.outer(t, self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, position_ids, unsqueeze_dim=1):
    cos = cos[position_ids].unsqueeze(unsqueeze_dim)
    sin = sin[position_ids].unsqueeze(unsqueeze_dim)
    b, h, s, d = q.shape
    q = q.view(b, h, s, d // 2, 2).transpose(4, 3).reshape(b, h, s, d)
    b, h, s, d = k.shape
    k = k.view(b, h, s, d // 2, 2).transpose(4, 3).reshape(b, h, s, d)
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed, k_embed


class DeepseekV2Attention(nn.Module):
    def __init__(self, config, layer_idx=0):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.attention_dropout = config.attention_dropout
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.q_lora_rank = config.q_lora_rank
        self.qk_rope_head_dim = config.qk_rope_head_dim
        self.kv_lora_rank = config.kv_lora_rank
        self.v_head_dim = config.v_head_dim
        self.qk_nope_head_dim = config.qk_nope_head_dim
        self.q_head_dim = config.qk_nope_head_dim + config.qk_rope_head_dim
        self.is_causal = True
        self._flash_attn_uses_top_left_mask = False

        self.q_proj = nn.Linear(self.hidden_size, self.num_heads * self.q_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(
            self.hidden_size, config.kv_lora_rank + config.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = DeepseekV2RMSNorm(config.kv_lora_rank)
        self.kv_b_proj = nn.Linear(
            config.kv_lora_rank,
            self.num_heads * (self.q_head_dim - self.qk_rope_head_dim + self.v_head_dim),
            bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.v_head_dim, self.hidden_size, bias=False)
        self.rotary_emb = DeepseekV2RotaryEmbedding(self.qk_rope_head_dim,
                                                    base=config.rope_theta)

        self.softmax_scale = self.q_head_dim ** (-0.5)
        if self.config.rope_scaling is not None:
            mscale_all_dim = self.config.rope_scaling.get("mscale_all_dim", 0)
            scaling_factor = self.config.rope_scaling["factor"]
            if mscale_all_dim:
                mscale = yarn_get_mscale(scaling_factor, mscale_all_dim)
                self.softmax_scale = self.softmax_scale * mscale * mscale


# ---- xtuner/model/modules/dispatch/deepseek_v2.py: deepseek_varlen_attn_forward ---------------
def deepseek_varlen_attn_forward(self, hidden_states, attention_mask=None, position_ids=None,
                                 past_key_value=None, output_attentions=False, use_cache=False,
                                 cumulative_len=None, max_seqlen=None, **kwargs):
    is_training = self.training

    bsz, q_len, _ = hidden_states.size()

    q = self.q_proj(hidden_states)
    q = q.view(bsz, q_len, self.num_heads, self.q_head_dim).transpose(1, 2)
    q_nope, q_pe = torch.split(
        q, [self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)

    compressed_kv = self.kv_a_proj_with_mqa(hidden_states)
    compressed_kv, k_pe = torch.split(
        compressed_kv, [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
    k_pe = k_pe.view(bsz, q_len, 1, self.qk_rope_head_dim).transpose(1, 2)
    kv = (
        self.kv_b_proj(self.kv_a_layernorm(compressed_kv)).view(
            bsz, q_len, self.num_heads,
            self.qk_nope_head_dim + self.v_head_dim).transpose(1, 2))

    k_nope, value_states = torch.split(
        kv, [self.qk_nope_head_dim, self.v_head_dim], dim=-1)

    assert position_ids is not None, '`position_ids` should not be None.'
    cos, sin = self.rotary_emb(value_states, seq_len=position_ids.max() + 1)
    q_pe, k_pe = apply_rotary_pos_emb(q_pe, k_pe, cos, sin, position_ids)

    query_states = k_pe.new_empty(bsz, self.num_heads, q_len, self.q_head_dim)
    query_states[:, :, :, :self.qk_nope_head_dim] = q_nope
    query_states[:, :, :, self.qk_nope_head_dim:] = q_pe

    key_states = k_pe.new_empty(bsz, self.num_heads, q_len, self.q_head_dim)
    key_states[:, :, :, :self.qk_nope_head_dim] = k_nope
    key_states[:, :, :, self.qk_nope_head_dim:] = k_pe

    if self.q_head_dim != self.v_head_dim:
        value_states = F.pad(value_states,
                             [0, self.q_head_dim - self.v_head_dim])

    # Reashape to the expected shape for Flash Attention
    query_states = query_states.transpose(1, 2)
    key_states = key_states.transpose(1, 2)
    value_states = value_states.transpose(1, 2)

    # ----------------- varlen flash attention forward ----------------------#
    dropout_rate = self.attention_dropout if self.training else 0.0

    if not self._flash_attn_uses_top_left_mask:
        causal = self.is_causal
    else:
        causal = self.is_causal and q_len != 1

    if FIXED:
        attn_output = varlen_flash_attn(
            query_states,
            key_states,
            value_states,
            cumulative_len,
            max_seqlen,
            softmax_scale=self.softmax_scale,
            causal=causal,
            dropout_p=dropout_rate)
    else:
        attn_output = varlen_flash_attn(
            query_states,
            key_states,
            value_states,
            cumulative_len,
            max_seqlen,
            causal=causal,
            dropout_p=dropout_rate)

    # ---------------- varlen flash attention forward end ------------------ #

    if self.q_head_dim != self.v_head_dim:
        attn_output = attn_output[:, :, :, :self.v_head_dim]

    attn_output = attn_output.reshape(bsz, q_len,
                                      self.num_heads * self.v_head_dim)
    attn_output = self.o_proj(attn_output)
    return attn_output, None, past_key_value


def main():
    torch.manual_seed(0)
    # DeepSeek-V2's config fields (YaRN rope scaling, mscale_all_dim), tiny sizes.
    config = SimpleNamespace(
        hidden_size=64,
        num_attention_heads=4,
        q_lora_rank=None,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        attention_dropout=0.0,
        rope_theta=10000,
        rope_scaling={
            "type": "yarn",
            "factor": 40,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 0.707,
            "mscale_all_dim": 0.707,
        },
    )
    attn = DeepseekV2Attention(config)
    with torch.no_grad():
        for p in attn.parameters():
            if p.dim() == 2:
                p.mul_(3.0)
    attn.train()

    # xtuner packed batch: one row, documents of 5 and 7 tokens; the collator's cumulative_len
    # and per-document position_ids.
    seqlens = [5, 7]
    total = sum(seqlens)
    hidden_states = torch.randn(1, total, config.hidden_size)
    cumulative_len = torch.tensor([0, 5, 12], dtype=torch.int32)
    max_seqlen = max(seqlens)
    position_ids = torch.cat([torch.arange(n) for n in seqlens]).unsqueeze(0)

    out, _, _ = deepseek_varlen_attn_forward(
        attn, hidden_states, position_ids=position_ids,
        cumulative_len=cumulative_len, max_seqlen=max_seqlen)

    print("softmax_scale on the module:", round(attn.softmax_scale, 6))
    print("attention output, token 6 (2nd document), first 4 dims:",
          [round(x, 4) for x in out[0, 6, :4].tolist()])
    print("attention output sum:", round(out.sum().item(), 4))


if __name__ == "__main__":
    main()
