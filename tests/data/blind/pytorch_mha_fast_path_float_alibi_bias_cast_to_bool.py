# Citation: pytorch/pytorch#107084 ("[regression] nn.MultiheadAttention does not respect adding of
#   floating point mask to attention for the fast path"), fixed by pytorch/pytorch#107641
#   ("Disable nn.MHA fastpath for floating point masks").
# Upstream: torch/nn/modules/activation.py MultiheadAttention.forward / merge_masks, and the
#   native fast path torch._native_multi_head_attention (aten/src/ATen/native/transformers/
#   attention.cpp: native_multi_head_attention_cpu -> masked_softmax, which does
#   `attn_mask = attn_mask->to(at::kBool)` before _masked_softmax).
# Bug: in eval/inference with self-attention (query is key is value, batch_first, even heads),
#   MultiheadAttention.forward took the native fast path even when the user passed an additive
#   float attn_mask. merge_masks added it to the (canonicalised, float) key_padding_mask and the
#   kernel's masked_softmax cast the merged float mask to bool, so every non-zero bias value
#   became "masked" instead of being added to the scores (here: an ALiBi distance bias).
# Fix: a floating-point attn_mask or key_padding_mask sets why_not_fast_path
#   ("floating-point masks are not supported for fast path."), so the slow path
#   (F.multi_head_attention_forward) adds the float mask to the scores.
# Kernels are written here in plain torch with the same semantics (CPU math path).
import math
import sys
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


def _none_or_dtype(input: Optional[torch.Tensor]):
    if input is None:
        return None
    return input.dtype


def _canonical_mask(mask, mask_name, other_type, other_name, target_type, check_other=True):
    if mask is not None:
        _mask_dtype = mask.dtype
        _mask_is_float = torch.is_floating_point(mask)
        if _mask_dtype != torch.bool and not _mask_is_float:
            raise AssertionError(f"only bool and floating types of {mask_name} are supported")
        if not _mask_is_float:
            mask = torch.zeros_like(mask, dtype=target_type).masked_fill_(mask, float("-inf"))
    return mask


# ---- stand-ins for the native kernels (aten/src/ATen/native/transformers/attention.cpp) ----
def _transform_bias_rescale_qkv(qkv, qkv_bias, num_head):
    B, T, three_d = qkv.shape
    D = three_d // 3
    dim_per_head = D // num_head
    qkv = qkv + qkv_bias
    q, k, v = qkv.split(D, dim=-1)
    q = q / math.sqrt(dim_per_head)
    shape = lambda t: t.view(B, T, num_head, dim_per_head).transpose(1, 2)
    return shape(q), shape(k), shape(v)


def _masked_softmax(attn_scores, attn_mask, dim, mask_type):
    # attn_mask: True = masked out. Rows that are fully masked come out as zeros on CPU.
    if mask_type == 1:  # (B, T) key padding mask
        attn_mask = attn_mask.view(attn_mask.size(0), 1, 1, attn_mask.size(1))
    attn_mask = attn_mask.expand_as(attn_scores)
    scores = attn_scores.masked_fill(attn_mask, float("-inf"))
    out = torch.softmax(scores, dim=dim)
    return torch.nan_to_num(out, nan=0.0)


def masked_softmax(attn_scores, attn_mask, query, mask_type):
    if attn_mask is not None and attn_mask.dtype != torch.bool:
        attn_mask = attn_mask.to(torch.bool)
    if attn_mask is not None:
        return _masked_softmax(attn_scores, attn_mask, attn_scores.dim() - 1, mask_type)
    return torch.softmax(attn_scores, dim=attn_scores.dim() - 1)


def _native_multi_head_attention(query, key, value, embed_dim, num_head, qkv_weight, qkv_bias,
                                 proj_weight, proj_bias, mask=None, need_weights=True,
                                 average_attn_weights=True, mask_type=None):
    B, T, D = query.shape
    qkv = query @ qkv_weight.t()
    q, k, v = _transform_bias_rescale_qkv(qkv, qkv_bias, num_head)
    qkt = q @ k.transpose(-2, -1)
    qkt = masked_softmax(qkt, mask, query, mask_type)
    attn_ctx = qkt @ v
    attn_ctx = attn_ctx.transpose(1, 2).reshape(B, T, D)
    proj = attn_ctx @ proj_weight.t() + proj_bias
    return proj, None


# ---- slow path: F.multi_head_attention_forward (need_weights=False branch), plain torch ----
def multi_head_attention_forward(query, key, value, embed_dim_to_check, num_heads, in_proj_weight,
                                 in_proj_bias, out_proj_weight, out_proj_bias, key_padding_mask=None,
                                 need_weights=False, attn_mask=None):
    tgt_len, bsz, embed_dim = query.shape
    src_len = key.shape[0]
    head_dim = embed_dim // num_heads
    proj = F.linear(query, in_proj_weight, in_proj_bias)
    proj = proj.unflatten(-1, (3, embed_dim)).unsqueeze(0).transpose(0, -2).squeeze(-2).contiguous()
    q, k, v = proj[0], proj[1], proj[2]
    if attn_mask is not None and attn_mask.dim() == 2:
        attn_mask = attn_mask.unsqueeze(0)
    q = q.view(tgt_len, bsz * num_heads, head_dim).transpose(0, 1)
    k = k.view(src_len, bsz * num_heads, head_dim).transpose(0, 1)
    v = v.view(src_len, bsz * num_heads, head_dim).transpose(0, 1)
    if key_padding_mask is not None:
        key_padding_mask = (key_padding_mask.view(bsz, 1, 1, src_len)
                            .expand(-1, num_heads, -1, -1).reshape(bsz * num_heads, 1, src_len))
        if attn_mask is None:
            attn_mask = key_padding_mask
        else:
            attn_mask = attn_mask + key_padding_mask
    if attn_mask is not None:
        if attn_mask.size(0) == 1 and attn_mask.dim() == 3:
            attn_mask = attn_mask.unsqueeze(0)
        else:
            attn_mask = attn_mask.view(bsz, num_heads, -1, src_len)
    q = q.view(bsz, num_heads, tgt_len, head_dim)
    k = k.view(bsz, num_heads, src_len, head_dim)
    v = v.view(bsz, num_heads, src_len, head_dim)
    scores = q @ k.transpose(-2, -1) / math.sqrt(head_dim)
    if attn_mask is not None:
        scores = scores + attn_mask
    attn_output = torch.softmax(scores, dim=-1) @ v
    attn_output = attn_output.permute(2, 0, 1, 3).contiguous().view(bsz * tgt_len, embed_dim)
    attn_output = F.linear(attn_output, out_proj_weight, out_proj_bias)
    return attn_output.view(tgt_len, bsz, embed_dim), None


class MultiheadAttention(nn.Module):
    def __init__(self, embed_dim, num_heads, batch_first=False):
        super().__init__()
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.batch_first = batch_first
        self.in_proj_weight = nn.Parameter(torch.empty(3 * embed_dim, embed_dim))
        self.in_proj_bias = nn.Parameter(torch.empty(3 * embed_dim))
        self.out_proj = nn.Linear(embed_dim, embed_dim)
        self.bias_k = self.bias_v = None
        self.add_zero_attn = False
        self._qkv_same_embed_dim = True
        nn.init.xavier_uniform_(self.in_proj_weight)
        nn.init.normal_(self.in_proj_bias, std=0.02)

    def merge_masks(self, attn_mask, key_padding_mask, query):
        mask_type = None
        merged_mask = None
        if key_padding_mask is not None:
            mask_type = 1
            merged_mask = key_padding_mask
        if attn_mask is not None:
            batch_size, seq_len, _ = query.shape
            mask_type = 2
            if attn_mask.dim() == 3:
                attn_mask_expanded = attn_mask.view(batch_size, -1, seq_len, seq_len)
            else:
                attn_mask_expanded = attn_mask.view(1, 1, seq_len, seq_len).expand(
                    batch_size, self.num_heads, -1, -1)
            merged_mask = attn_mask_expanded
            if key_padding_mask is not None:
                key_padding_mask_expanded = key_padding_mask.view(batch_size, 1, 1, seq_len).expand(
                    -1, self.num_heads, -1, -1)
                merged_mask = attn_mask_expanded + key_padding_mask_expanded
        return merged_mask, mask_type

    def forward(self, query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None):
        why_not_fast_path = ""
        if FIXED:
            if ((attn_mask is not None and torch.is_floating_point(attn_mask))
                    or (key_padding_mask is not None) and torch.is_floating_point(key_padding_mask)):
                why_not_fast_path = "floating-point masks are not supported for fast path."

        is_batched = query.dim() == 3

        key_padding_mask = _canonical_mask(
            mask=key_padding_mask, mask_name="key_padding_mask",
            other_type=_none_or_dtype(attn_mask), other_name="attn_mask", target_type=query.dtype)
        attn_mask = _canonical_mask(
            mask=attn_mask, mask_name="attn_mask", other_type=None, other_name="",
            target_type=query.dtype, check_other=False)

        if why_not_fast_path:
            pass
        elif not is_batched:
            why_not_fast_path = "input not batched"
        elif query is not key or key is not value:
            why_not_fast_path = "non-self attention was used"
        elif self.training:
            why_not_fast_path = "training is enabled"
        elif (self.num_heads % 2) != 0:
            why_not_fast_path = "self.num_heads is not even"
        elif not self.batch_first:
            why_not_fast_path = "batch_first was not True"
        elif torch.is_grad_enabled() and any(p.requires_grad for p in self.parameters()):
            why_not_fast_path = "grad is enabled and at least one of the weights requires_grad"

        if not why_not_fast_path:
            merged_mask, mask_type = self.merge_masks(attn_mask, key_padding_mask, query)
            return _native_multi_head_attention(
                query, key, value, self.embed_dim, self.num_heads,
                self.in_proj_weight, self.in_proj_bias, self.out_proj.weight, self.out_proj.bias,
                merged_mask, need_weights, True, mask_type)

        if self.batch_first and is_batched:
            query = key = value = query.transpose(1, 0)
        attn_output, attn_output_weights = multi_head_attention_forward(
            query, key, value, self.embed_dim, self.num_heads, self.in_proj_weight,
            self.in_proj_bias, self.out_proj.weight, self.out_proj.bias,
            key_padding_mask=key_padding_mask, need_weights=need_weights, attn_mask=attn_mask)
        if self.batch_first and is_batched:
            return attn_output.transpose(1, 0), attn_output_weights
        return attn_output, attn_output_weights


def alibi_slopes(num_heads):
    start = 2 ** (-8.0 / num_heads)
    return torch.tensor([start ** (i + 1) for i in range(num_heads)])


def build_alibi_bias(batch_size, num_heads, seq_len):
    # symmetric (bidirectional) ALiBi: -slope * |i - j|, one (L, L) bias per head, as a
    # (N * num_heads, L, L) float attn_mask
    pos = torch.arange(seq_len)
    dist = (pos[None, :] - pos[:, None]).abs().float()
    bias = -alibi_slopes(num_heads)[:, None, None] * dist[None]
    return bias.unsqueeze(0).expand(batch_size, -1, -1, -1).reshape(batch_size * num_heads, seq_len, seq_len)


class EncoderLayer(nn.Module):
    def __init__(self, d_model, nhead, dim_ff):
        super().__init__()
        self.self_attn = MultiheadAttention(d_model, nhead, batch_first=True)
        self.linear1 = nn.Linear(d_model, dim_ff)
        self.linear2 = nn.Linear(dim_ff, d_model)
        self.norm1 = nn.LayerNorm(d_model)
        self.norm2 = nn.LayerNorm(d_model)

    def forward(self, x, attn_bias, key_padding_mask):
        h = self.norm1(x)
        x = x + self.self_attn(h, h, h, key_padding_mask=key_padding_mask, need_weights=False,
                               attn_mask=attn_bias)[0]
        x = x + self.linear2(F.gelu(self.linear1(self.norm2(x))))
        return x


class AlibiEncoderClassifier(nn.Module):
    def __init__(self, vocab=50, d_model=32, nhead=4, dim_ff=64, num_layers=2, num_classes=3):
        super().__init__()
        self.nhead = nhead
        self.embed = nn.Embedding(vocab, d_model, padding_idx=0)
        self.layers = nn.ModuleList([EncoderLayer(d_model, nhead, dim_ff) for _ in range(num_layers)])
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, num_classes)

    def forward(self, input_ids):
        B, L = input_ids.shape
        key_padding_mask = input_ids.eq(0)  # True = padding
        attn_bias = build_alibi_bias(B, self.nhead, L)
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x, attn_bias, key_padding_mask)
        x = self.norm(x)
        keep = (~key_padding_mask).unsqueeze(-1).float()
        pooled = (x * keep).sum(1) / keep.sum(1)
        return self.head(pooled)


model = AlibiEncoderClassifier()
model.eval()

lengths = [10, 7, 4]
L = max(lengths)
input_ids = torch.zeros(len(lengths), L, dtype=torch.long)
for b, n in enumerate(lengths):
    input_ids[b, :n] = torch.randint(1, 50, (n,))
labels = torch.tensor([0, 2, 1])

with torch.no_grad():
    logits = model(input_ids)
    loss = F.cross_entropy(logits, labels)

print("logits:")
for row in logits:
    print("  " + " ".join(f"{v:+.4f}" for v in row.tolist()))
print(f"loss: {loss.item():.4f}")
print("predictions:", logits.argmax(-1).tolist())
