# Written after lucidrains/CoLT5-attention 0f34926 ("fix masking in attention class"), another way: a left-padded batch,
# queries cross-attend to the top-k key/value tokens a scorer selects; the selected tokens' padding mask is gathered
# and spread over the queries as a (B, Lq, Lk) bool mask, but the attention helper never passes it on, so selected
# padding tokens are attended.
# --fixed hands the mask to the kernel.
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


def attend(q, k, v, attn_mask=None):
    """q (B, H, Lq, D), k/v (B, H, Lk, D); attn_mask: bool (B, Lq, Lk), True = attend, or None."""
    if FIXED:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask.unsqueeze(1))
    return F.scaled_dot_product_attention(q, k, v)


class SelectedKVAttention(nn.Module):
    def __init__(self, dim, heads, keep):
        super().__init__()
        self.heads, self.keep = heads, keep
        self.score = nn.Linear(dim, 1)
        self.to_q = nn.Linear(dim, dim)
        self.to_kv = nn.Linear(dim, 2 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x, padding):  # padding: (B, L) True where the token is padding
        b, n, d = x.shape
        scores = self.score(x).squeeze(-1)
        picked = scores.topk(self.keep, dim=-1).indices.sort(dim=-1).values      # (B, keep) positions
        ctx = torch.take_along_dim(x, picked[..., None], dim=1)                  # (B, keep, D)
        pad = torch.take_along_dim(padding, picked, dim=1)                       # (B, keep)
        allowed = (~pad)[:, None, :].expand(b, n, self.keep)                     # (B, Lq, keep) queries x kept keys
        split = lambda t: t.view(b, -1, self.heads, d // self.heads).transpose(1, 2)
        q = split(self.to_q(x))
        k, v = (split(t) for t in self.to_kv(ctx).chunk(2, dim=-1))
        out = attend(q, k, v, attn_mask=allowed)
        return self.out(out.transpose(1, 2).reshape(b, n, d))


B, L, D = 2, 10, 16
lengths = (10, 5)
padding = torch.arange(L)[None, :] < (L - torch.tensor(lengths))[:, None]  # left padding
model = SelectedKVAttention(D, heads=2, keep=7).eval()
x = torch.randn(B, L, D)
with torch.no_grad():
    out = model(x, padding)
    x2 = x.clone()
    x2[padding] = torch.randn(int(padding.sum()), D) * 3
    out2 = model(x2, padding)
real = ~padding
print(f"max change of real-token outputs when only padding changes: {(out - out2)[real].abs().max().item():.3e}")
