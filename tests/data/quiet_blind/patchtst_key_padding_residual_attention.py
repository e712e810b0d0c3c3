# Follows PatchTST PatchTST_supervised/layers/PatchTST_backbone.py _ScaledDotProductAttention / _MultiheadAttention
# (res_attention=True): a float attn_mask is *added*, a bool key_padding_mask (True = pad patch) is filled with -inf,
# and the masked pre-softmax scores are passed on as `prev` to the next layer. Series with fewer patches are right-padded.
import math
import numpy as np
import torch
import torch.nn.functional as F

torch.manual_seed(0)
torch.set_default_dtype(torch.float64)


class _ScaledDotProductAttention(torch.nn.Module):
    def __init__(self, d_model, n_heads):
        super().__init__()
        self.scale = (d_model // n_heads) ** -0.5

    def forward(self, q, k, v, prev=None, key_padding_mask=None, attn_mask=None):
        attn_scores = torch.matmul(q, k) * self.scale  # q [bs x h x q_len x d_k], k [bs x h x d_k x seq_len]
        if prev is not None:
            attn_scores = attn_scores + prev
        if attn_mask is not None:
            if attn_mask.dtype == torch.bool:
                attn_scores.masked_fill_(attn_mask, -np.inf)
            else:
                attn_scores += attn_mask
        if key_padding_mask is not None:
            attn_scores.masked_fill_(key_padding_mask.unsqueeze(1).unsqueeze(2), -np.inf)
        attn_weights = F.softmax(attn_scores, dim=-1)
        output = torch.matmul(attn_weights, v)
        return output, attn_weights, attn_scores


class _MultiheadAttention(torch.nn.Module):
    def __init__(self, d_model, n_heads):
        super().__init__()
        self.n_heads, self.d_k = n_heads, d_model // n_heads
        self.W_Q = torch.nn.Linear(d_model, d_model)
        self.W_K = torch.nn.Linear(d_model, d_model)
        self.W_V = torch.nn.Linear(d_model, d_model)
        self.sdp_attn = _ScaledDotProductAttention(d_model, n_heads)
        self.to_out = torch.nn.Linear(d_model, d_model)

    def forward(self, Q, prev=None, key_padding_mask=None, attn_mask=None):
        bs = Q.size(0)
        q_s = self.W_Q(Q).view(bs, -1, self.n_heads, self.d_k).transpose(1, 2)
        k_s = self.W_K(Q).view(bs, -1, self.n_heads, self.d_k).permute(0, 2, 3, 1)
        v_s = self.W_V(Q).view(bs, -1, self.n_heads, self.d_k).transpose(1, 2)
        out, w, scores = self.sdp_attn(q_s, k_s, v_s, prev=prev, key_padding_mask=key_padding_mask, attn_mask=attn_mask)
        out = out.transpose(1, 2).contiguous().view(bs, -1, self.n_heads * self.d_k)
        return self.to_out(out), w, scores


d_model, n_heads, n_layers = 32, 4, 3
layers = torch.nn.ModuleList([_MultiheadAttention(d_model, n_heads) for _ in range(n_layers)])
norms = torch.nn.ModuleList([torch.nn.LayerNorm(d_model) for _ in range(n_layers)])


def local_bias(n, w=2):
    i = torch.arange(n)
    # float attn_mask: 0 inside a +-w patch window, -inf outside (added, not filled)
    return torch.where((i[:, None] - i[None, :]).abs() <= w, 0.0, float("-inf"))


def encoder(x, key_padding_mask=None):
    scores = None
    attn_mask = local_bias(x.shape[1])
    for attn, norm in zip(layers, norms):
        y, _, scores = attn(x, prev=scores, key_padding_mask=key_padding_mask, attn_mask=attn_mask)
        x = norm(x + y)
    return x


lens = [7, 4, 6]
P = max(lens)
x = torch.randn(len(lens), P, d_model)
key_padding_mask = torch.arange(P)[None, :] >= torch.tensor(lens)[:, None]  # True = padded patch
batched = encoder(x, key_padding_mask)

diff = 0.0
for b, n in enumerate(lens):
    alone = encoder(x[b : b + 1, :n])
    diff = max(diff, (batched[b, :n] - alone[0]).abs().max().item())
print(f"max abs diff (padded batch vs each series alone): {diff:.3e}")
assert diff < 1e-12
