# NVIDIA-NeMo/Automodel#491 (commit 1e1e61fa2): DeepseekV3Model did not pass attention_mask down to the MLA blocks,
# and the TE branch, when given one, used attn_mask_type="padding" with window (-1, -1) (no causality); fix: padding_causal.
import sys
import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class DeepseekV3Config:
    vocab_size = 64
    hidden_size = 32
    num_attention_heads = 2
    num_hidden_layers = 2
    q_lora_rank = None
    kv_lora_rank = 16
    qk_nope_head_dim = 8
    qk_rope_head_dim = 4
    v_head_dim = 8


class DotProductAttention(nn.Module):
    """Transformer Engine DotProductAttention semantics, qkv_format='bshd'; attention_mask True = masked out."""

    def __init__(self, num_attention_heads, kv_channels, attn_mask_type="causal", qkv_format="bshd", softmax_scale=None):
        super().__init__()
        self.attn_mask_type = attn_mask_type
        self.softmax_scale = softmax_scale

    def forward(self, q, k, v, attention_mask=None, attn_mask_type=None, window_size=None):
        attn_mask_type = attn_mask_type or self.attn_mask_type
        b, s = q.shape[:2]
        keep = torch.ones(b, 1, s, s, dtype=torch.bool)
        if "causal" in attn_mask_type:
            keep &= torch.ones(s, s, dtype=torch.bool).tril()
        if "padding" in attn_mask_type:
            keep &= ~attention_mask
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, scale=self.softmax_scale)
        out = out.masked_fill(~keep.any(-1, keepdim=True), 0.0)  # fully masked rows give zeros
        return out.transpose(1, 2)


def apply_rotary_emb(x, position_ids):  # x: (b, s, h, d)
    d = x.shape[-1]
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    ang = position_ids[..., None].float() * inv
    cos, sin = ang.cos()[:, :, None], ang.sin()[:, :, None]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


def preprocess_args_and_kwargs_for_attn(q, k, v, attention_mask):
    if attention_mask is None:
        attn_kwargs = {}
    else:
        padding_mask = attention_mask.bool().logical_not()
        attn_kwargs = {
            "attn_mask_type": "padding_causal" if FIXED else "padding",
            "window_size": (-1, 0) if FIXED else (-1, -1),
            "attention_mask": padding_mask.unsqueeze(1).unsqueeze(2),
        }
    return q, k, v, attn_kwargs


class MLA(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.n_heads = config.num_attention_heads
        self.kv_lora_rank = config.kv_lora_rank
        self.qk_nope_head_dim = config.qk_nope_head_dim
        self.qk_rope_head_dim = config.qk_rope_head_dim
        self.qk_head_dim = self.qk_nope_head_dim + self.qk_rope_head_dim
        self.v_head_dim = config.v_head_dim
        self.q_proj = nn.Linear(config.hidden_size, self.n_heads * self.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(config.hidden_size, self.kv_lora_rank + self.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = nn.RMSNorm(self.kv_lora_rank)
        self.kv_b_proj = nn.Linear(self.kv_lora_rank, self.n_heads * (self.qk_nope_head_dim + self.v_head_dim), bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.v_head_dim, config.hidden_size, bias=False)
        self.attn_func = DotProductAttention(self.n_heads, (self.qk_head_dim, self.v_head_dim), attn_mask_type="causal",
                                             softmax_scale=self.qk_head_dim ** -0.5)

    def forward(self, x, position_ids, attention_mask=None):
        bsz, seq_len, _ = x.size()
        q = self.q_proj(x).view(bsz, seq_len, self.n_heads, self.qk_head_dim)
        q_nope, q_pe = torch.split(q, [self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        q = torch.cat([q_nope, apply_rotary_emb(q_pe, position_ids)], dim=-1)
        kv, k_pe = torch.split(self.kv_a_proj_with_mqa(x), [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(kv)).view(bsz, seq_len, self.n_heads, -1)
        k_nope, v = torch.split(kv, [self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        k_pe = apply_rotary_emb(k_pe.unsqueeze(2), position_ids).expand(-1, -1, self.n_heads, -1)
        k = torch.cat([k_nope, k_pe], dim=-1)
        q, k, v, attn_kwargs = preprocess_args_and_kwargs_for_attn(q, k, v, attention_mask)
        out = self.attn_func(q, k, v, **attn_kwargs)
        return self.o_proj(out.flatten(2))


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.input_layernorm = nn.RMSNorm(config.hidden_size)
        self.self_attn = MLA(config)

    def forward(self, x, position_ids, attention_mask=None, padding_mask=None):
        return x + self.self_attn(self.input_layernorm(x), position_ids, attention_mask=attention_mask)


class DeepseekV3Model(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([Block(config) for _ in range(config.num_hidden_layers)])
        self.norm = nn.RMSNorm(config.hidden_size)

    def forward(self, input_ids, position_ids, attention_mask=None, padding_mask=None):
        h = self.embed_tokens(input_ids)
        for layer in self.layers:
            if FIXED:
                h = layer(h, position_ids, attention_mask=attention_mask, padding_mask=padding_mask)
            else:
                h = layer(h, position_ids, padding_mask=padding_mask)
        return self.norm(h)


model = DeepseekV3Model(DeepseekV3Config()).eval()
seqs = [[4, 17, 9, 30, 2, 11], [8, 5, 23]]
L = max(len(s) for s in seqs)
input_ids = torch.tensor([[0] * (L - len(s)) + s for s in seqs])  # left padded
attention_mask = (torch.arange(L)[None] >= torch.tensor([L - len(s) for s in seqs])[:, None]).long()
position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)

with torch.no_grad():
    out = model(input_ids, position_ids, attention_mask=attention_mask, padding_mask=attention_mask == 0)
    short = torch.tensor([seqs[1]])
    ref = model(short, torch.arange(len(seqs[1]))[None], attention_mask=torch.ones_like(short))

diff = (out[1, L - len(seqs[1]):] - ref[0]).abs().max().item()
print(f"fixed={FIXED} max |padded-batch - unpadded| hidden on real tokens of the short sequence: {diff:.3e}")
