# Follows Informer2020 utils/masking.py TriangularCausalMask and models/attn.py FullAttention.forward:
# bool mask with True = masked (triu diagonal=1) filled with -inf in decoder self-attention; cross-attention to the
# distilled (shorter) encoder output takes mask_flag=False, so 12 decoder queries see all 5 encoder keys.
import math
import numpy as np
import torch

torch.manual_seed(0)
torch.set_default_dtype(torch.float64)


class TriangularCausalMask:
    def __init__(self, B, L, device="cpu"):
        mask_shape = [B, 1, L, L]
        with torch.no_grad():
            self._mask = torch.triu(torch.ones(mask_shape, dtype=torch.bool), diagonal=1).to(device)

    @property
    def mask(self):
        return self._mask


class FullAttention(torch.nn.Module):
    def __init__(self, mask_flag=True, scale=None):
        super().__init__()
        self.mask_flag = mask_flag
        self.scale = scale

    def forward(self, queries, keys, values, attn_mask):
        B, L, H, E = queries.shape
        _, S, _, D = values.shape
        scale = self.scale or 1.0 / math.sqrt(E)
        scores = torch.einsum("blhe,bshe->bhls", queries, keys)
        if self.mask_flag:
            if attn_mask is None:
                attn_mask = TriangularCausalMask(B, L, device=queries.device)
            scores.masked_fill_(attn_mask.mask, -np.inf)
        A = torch.softmax(scale * scores, dim=-1)
        V = torch.einsum("bhls,bshd->blhd", A, values)
        return V.contiguous()


B, H, E = 2, 4, 8
label_len, pred_len, enc_len = 6, 6, 5
L = label_len + pred_len
q = torch.randn(B, L, H, E)
k = torch.randn(B, L, H, E)
v = torch.randn(B, L, H, E)
mem_k = torch.randn(B, enc_len, H, E)
mem_v = torch.randn(B, enc_len, H, E)

self_out = FullAttention(mask_flag=True)(q, k, v, None)
cross_out = FullAttention(mask_flag=False)(self_out, mem_k, mem_v, None)

# reference: explicit per-query loop
ref_self = torch.zeros_like(self_out)
for b in range(B):
    for h in range(H):
        for i in range(L):
            s = (k[b, : i + 1, h] @ q[b, i, h]) / math.sqrt(E)
            ref_self[b, i, h] = torch.softmax(s, 0) @ v[b, : i + 1, h]
ref_cross = torch.zeros_like(cross_out)
for b in range(B):
    for h in range(H):
        for i in range(L):
            s = (mem_k[b, :, h] @ ref_self[b, i, h]) / math.sqrt(E)
            ref_cross[b, i, h] = torch.softmax(s, 0) @ mem_v[b, :, h]

diff = max((self_out - ref_self).abs().max().item(), (cross_out - ref_cross).abs().max().item())
print(f"max abs diff: {diff:.3e}")
assert diff < 1e-12
