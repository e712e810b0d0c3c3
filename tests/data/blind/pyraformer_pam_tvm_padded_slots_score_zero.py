# ant-research/Pyraformer#5 (fixed in commit 2afe70b): the pyramidal attention (PAM-TVM) gathers each query's keys through
# q_k_mask, whose unused slots are -1; graph_mm padded their scores with 0 instead of -1e9, so softmax gave the empty slots weight.
import math
import sys

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


def get_q_k(input_size, window_size, stride):
    """query -> key index table of the pyramid (intra-scale window, children, parent); -1 marks an unused slot."""
    sizes = [input_size]
    while len(sizes) < 4:
        sizes.append(sizes[-1] // stride)
    starts = [sum(sizes[:i]) for i in range(4)]
    full_length = sum(sizes)
    max_attn = window_size + stride + (sizes[-2] - (sizes[-1] - 1) * stride) + 1
    mask = torch.zeros(full_length, max_attn, dtype=torch.long) - 1
    for lvl, (s, n) in enumerate(zip(starts, sizes)):
        for i in range(n):
            row = mask[s + i]
            nb = s + i + torch.arange(window_size) - window_size // 2
            nb[(nb < s) | (nb > s + n - 1)] = -1
            row[:window_size] = nb
            if lvl > 0:  # children in the scale below
                cs, cn = starts[lvl - 1], sizes[lvl - 1]
                lo = i * stride
                hi = cn if i == n - 1 else (i + 1) * stride
                row[window_size:window_size + hi - lo] = cs + torch.arange(lo, hi)
            if lvl < 3:  # parent in the scale above
                row[-1] = starts[lvl + 1] + min(i // stride, sizes[lvl + 1] - 1)
    return mask


def graph_mm(t1, t2, q_k_mask, is_t1_diagonaled, padding):
    """CPU version of hierarchical_mm_tvm.graph_mm.
    is_t1_diagonaled=False: (B, L, H, D) x (B, L, H, D) -> (B, L, H, M) scores, unused slots filled with `padding`.
    is_t1_diagonaled=True:  (B, L, H, M) x (B, L, H, D) -> (B, L, H, D), unused slots skipped."""
    valid = q_k_mask >= 0
    idx = q_k_mask.clamp(min=0)
    gathered = t2[:, idx]  # B, L, M, H, D
    if not is_t1_diagonaled:
        scores = torch.einsum("blhd,blmhd->blhm", t1, gathered)
        return scores.masked_fill(~valid[None, :, None, :], padding)
    w = t1.masked_fill(~valid[None, :, None, :], 0.0)
    return torch.einsum("blhm,blmhd->blhd", w, gathered)


class GraphSelfAttention(nn.Module):
    def __init__(self, d_model=16, n_head=2, d_k=8, seq_len=16, window_size=3, stride_size=2):
        super().__init__()
        self.n_head, self.d_k = n_head, d_k
        self.w_qs = nn.Linear(d_model, n_head * d_k, bias=False)
        self.w_ks = nn.Linear(d_model, n_head * d_k, bias=False)
        self.w_vs = nn.Linear(d_model, n_head * d_k, bias=False)
        self.fc = nn.Linear(d_k * n_head, d_model)
        self.layer_norm = nn.LayerNorm(d_model, eps=1e-6)
        self.q_k_mask = get_q_k(seq_len, window_size, stride_size)

    def forward(self, hidden_states):
        residual = hidden_states
        bsz, seq_len, _ = hidden_states.size()
        q = self.layer_norm(hidden_states)
        q = self.w_qs(q)
        k = self.w_ks(hidden_states)
        v = self.w_vs(hidden_states)
        q /= math.sqrt(self.d_k)
        q = q.view(bsz, seq_len, self.n_head, self.d_k)
        k = k.view(bsz, seq_len, self.n_head, self.d_k)
        # attn_weights.size(): (batch_size, L, num_heads, max_attn)
        padding = -1000000000 if FIXED else 0
        attn_weights = graph_mm(q, k, self.q_k_mask, False, padding)
        attn_weights = F.softmax(attn_weights, dim=-1)
        v = v.view(bsz, seq_len, self.n_head, self.d_k)
        attn = graph_mm(attn_weights, v, self.q_k_mask, True, 0)
        attn = attn.reshape(bsz, seq_len, self.n_head * self.d_k)
        return self.fc(attn) + residual


def dense_reference(layer, x):
    """Same layer as ordinary masked attention over the pyramid graph."""
    B, L, _ = x.shape
    allowed = torch.zeros(L, L, dtype=torch.bool)
    for l in range(L):
        for j in layer.q_k_mask[l]:
            if j >= 0:
                allowed[l, j] = True
    q = layer.w_qs(layer.layer_norm(x)).view(B, L, layer.n_head, layer.d_k).transpose(1, 2)
    k = layer.w_ks(x).view(B, L, layer.n_head, layer.d_k).transpose(1, 2)
    v = layer.w_vs(x).view(B, L, layer.n_head, layer.d_k).transpose(1, 2)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
    return layer.fc(out.transpose(1, 2).reshape(B, L, -1)) + x


if __name__ == "__main__":
    layer = GraphSelfAttention().eval()
    full_length = layer.q_k_mask.shape[0]  # 16 + 8 + 4 + 2 pyramid nodes
    x = torch.randn(2, full_length, 16)
    with torch.no_grad():
        out = layer(x)
        ref = dense_reference(layer, x)
    print(f"fixed={FIXED} slots/query={layer.q_k_mask.shape[1]} unused={(layer.q_k_mask < 0).sum().item()} "
          f"max|PAM-TVM - dense masked attention|={(out - ref).abs().max():.4f}")
