# huggingface/diffusers#14397 (fix: PR #14396): the _native_npu attention backend cast every mask to bool and
# inverted it for npu_fusion_attention, so LTX-2's additive text mask (0 / -10000) kept padding and dropped real tokens.
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


def npu_fusion_attention(query, key, value, head_num, input_layout="BSND", atten_mask=None, scale=1.0, keep_prob=1.0):
    # CPU stand-in for torch_npu.npu_fusion_attention: atten_mask is boolean, True = discard
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # BSND -> BNSD
    keep = None if atten_mask is None else ~atten_mask
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, scale=scale)
    return (out.transpose(1, 2),)


def _maybe_modify_attn_mask_npu(query, key, attn_mask):
    if attn_mask is None:
        return None
    if attn_mask.ndim == 4 and attn_mask.shape[1:3] == (1, 1):
        attn_mask = attn_mask.expand(-1, 1, query.shape[1], key.shape[1])
    # SDPA bool masks keep True positions, npu_fusion_attention discards them
    return torch.logical_not(attn_mask.bool())


def _native_attention(query, key, value, attn_mask=None, scale=None):
    q, k, v = (t.permute(0, 2, 1, 3) for t in (query, key, value))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=scale)
    return out.permute(0, 2, 1, 3)


def _native_npu_attention(query, key, value, attn_mask=None, scale=None):
    if FIXED and attn_mask is not None and torch.is_floating_point(attn_mask):
        # additive masks keep their values: route them through native SDPA
        return _native_attention(query, key, value, attn_mask=attn_mask, scale=scale)
    attn_mask = _maybe_modify_attn_mask_npu(query, key, attn_mask)
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    return npu_fusion_attention(query, key, value, query.size(2), input_layout="BSND", atten_mask=attn_mask, scale=scale)[0]


def dispatch_attention_fn(query, key, value, attn_mask=None, backend="_native_npu"):
    fn = _native_npu_attention if backend == "_native_npu" else _native_attention
    return fn(query, key, value, attn_mask=attn_mask)


class LTX2Attention(nn.Module):
    def __init__(self, query_dim=32, cross_attention_dim=24, heads=4):
        super().__init__()
        self.heads = heads
        self.to_q = nn.Linear(query_dim, query_dim)
        self.to_k = nn.Linear(cross_attention_dim, query_dim)
        self.to_v = nn.Linear(cross_attention_dim, query_dim)
        self.to_out = nn.Linear(query_dim, query_dim)

    def forward(self, hidden_states, encoder_hidden_states, attention_mask=None, backend="_native_npu"):
        q = self.to_q(hidden_states).unflatten(2, (self.heads, -1))
        k = self.to_k(encoder_hidden_states).unflatten(2, (self.heads, -1))
        v = self.to_v(encoder_hidden_states).unflatten(2, (self.heads, -1))
        out = dispatch_attention_fn(q, k, v, attn_mask=attention_mask, backend=backend)
        return self.to_out(out.flatten(2, 3))


class LTX2TransformerBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(32)
        self.attn2 = LTX2Attention()

    def forward(self, hidden_states, encoder_hidden_states, encoder_attention_mask, backend):
        return hidden_states + self.attn2(self.norm(hidden_states), encoder_hidden_states, encoder_attention_mask, backend)


block = LTX2TransformerBlock().eval()
latents = torch.randn(2, 12, 32)  # video tokens
prompt_embeds = torch.randn(2, 8, 24)  # padded text encoder output
prompt_attention_mask = torch.tensor([[1, 1, 1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1, 1, 0]])
# as in LTX2VideoTransformer3DModel.forward: 2D keep mask -> additive bias
encoder_attention_mask = (1 - prompt_attention_mask.to(latents.dtype)) * -10000.0
encoder_attention_mask = encoder_attention_mask.unsqueeze(1).unsqueeze(1)  # [B, 1, 1, S_text]
with torch.no_grad():
    out = block(latents, prompt_embeds, encoder_attention_mask, backend="_native_npu")
    ref = block(latents, prompt_embeds, encoder_attention_mask, backend="native")  # SDPA, the reference backend
print("_native_npu vs native SDPA backend, max diff: %.4g" % (out - ref).abs().max().item())
