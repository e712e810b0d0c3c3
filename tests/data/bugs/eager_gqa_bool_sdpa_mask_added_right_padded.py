# The same bug as TransformerLens#1198 written another way: a Llama-style eager attention (grouped-query heads,
# repeat_kv) handed the boolean 4D mask an SDPA mask builder makes (True = attend) adds it to the scores as it is
# (`attn_weights + causal_mask`), so on a right-padded batch the short row's real queries attend to its pad keys and
# to later tokens (+1 on the kept cells, +0 on the masked ones: nothing is masked). The fix turns the bool into an
# additive mask (0 where kept, finfo.min where masked) before adding it.
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

HIDDEN, HEADS, KV_HEADS = 32, 4, 2
HEAD_DIM = HIDDEN // HEADS


def repeat_kv(hidden, n_rep):
    b, h, t, d = hidden.shape
    return hidden[:, :, None].expand(b, h, n_rep, t, d).reshape(b, h * n_rep, t, d)


def sdpa_style_mask(attention_mask, dtype):
    """(B, 1, T, T) bool, True = may attend: causal and the row's real keys."""
    t = attention_mask.shape[1]
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    mask = causal[None, None] & attention_mask[:, None, None, :].bool()
    if FIXED:
        return torch.zeros(mask.shape, dtype=dtype).masked_fill(~mask, torch.finfo(dtype).min)
    return mask


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj = nn.Linear(HIDDEN, HEADS * HEAD_DIM, bias=False)
        self.k_proj = nn.Linear(HIDDEN, KV_HEADS * HEAD_DIM, bias=False)
        self.v_proj = nn.Linear(HIDDEN, KV_HEADS * HEAD_DIM, bias=False)
        self.o_proj = nn.Linear(HEADS * HEAD_DIM, HIDDEN, bias=False)

    def forward(self, hidden, causal_mask):
        b, t, _ = hidden.shape
        q = self.q_proj(hidden).view(b, t, HEADS, HEAD_DIM).transpose(1, 2)
        k = repeat_kv(self.k_proj(hidden).view(b, t, KV_HEADS, HEAD_DIM).transpose(1, 2), HEADS // KV_HEADS)
        v = repeat_kv(self.v_proj(hidden).view(b, t, KV_HEADS, HEAD_DIM).transpose(1, 2), HEADS // KV_HEADS)
        attn_weights = torch.matmul(q, k.transpose(2, 3)) * HEAD_DIM ** -0.5
        attn_weights = torch.add(attn_weights, causal_mask[:, :, :, : k.shape[-2]])
        attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(q.dtype)
        out = torch.matmul(attn_weights, v).transpose(1, 2).reshape(b, t, -1)
        return self.o_proj(out)


layer = Attention().eval()
x = torch.randn(2, 8, HIDDEN)
attention_mask = torch.tensor([[1] * 8, [1] * 5 + [0] * 3])  # right padded
with torch.no_grad():
    out = layer(x, sdpa_style_mask(attention_mask, x.dtype))
    alone = layer(x[1:, :5], sdpa_style_mask(attention_mask[1:, :5], x.dtype))
print(f"max |padded row - the row alone| over real tokens: {(out[1, :5] - alone[0]).abs().max().item():.6f}")
