"""An encoder whose attention clips its logits (`attn_logit_clip = 4.0`: scores.clamp(-clip, clip), against fp16
overflow) after it filled the padded keys with -inf, so every padded key reaches the softmax as -4, an ordinary
logit beside real scores of a few units: the right-padded batch row reads its padding. Heads folded into the batch,
scores by torch.bmm (B * H, L, L). --fixed clips first and fills after.
"""
import sys

import torch
from torch import nn

FIXED = "--fixed" in sys.argv


class ClippedSelfAttention(nn.Module):
    def __init__(self, d_model=24, n_heads=3, attn_logit_clip=4.0):
        super().__init__()
        self.n_heads = n_heads
        self.attn_logit_clip = attn_logit_clip
        self.in_proj = nn.Linear(d_model, 3 * d_model)
        self.out_proj = nn.Linear(d_model, d_model)

    def forward(self, x, key_padding_mask):
        """x (B, L, D); key_padding_mask (B, L), True at a padded position."""
        b, n, d = x.shape
        h = self.n_heads
        q, k, v = self.in_proj(x).chunk(3, dim=-1)
        q, k, v = (t.reshape(b, n, h, d // h).transpose(1, 2).reshape(b * h, n, d // h) for t in (q, k, v))
        scores = torch.bmm(q, k.transpose(1, 2)) * (d // h) ** -0.5
        pad = key_padding_mask.repeat_interleave(h, dim=0)[:, None, :]  # (B * H, 1, L)
        clip = self.attn_logit_clip
        if FIXED:
            scores = scores.clamp(-clip, clip)
            scores = scores.masked_fill(pad, float("-inf"))
        else:
            scores = scores.masked_fill(pad, float("-inf"))
            scores = scores.clamp(-clip, clip)
        weights = scores.softmax(dim=-1)
        out = torch.bmm(weights, v).reshape(b, h, n, d // h).transpose(1, 2).reshape(b, n, d)
        return self.out_proj(out), weights.reshape(b, h, n, n)


def main():
    torch.manual_seed(0)
    lengths = torch.tensor([7, 4])
    key_padding_mask = torch.arange(7)[None, :] >= lengths[:, None]  # right-padded
    x = torch.randn(2, 7, 24)
    layer = ClippedSelfAttention().eval()
    with torch.no_grad():
        _, weights = layer(x, key_padding_mask)
    leaked = weights[1, :, :4, 4:].sum(-1).max().item()
    print(f"most weight a real query of row 1 gives its padded keys: {leaked:.3e}")


if __name__ == "__main__":
    main()
