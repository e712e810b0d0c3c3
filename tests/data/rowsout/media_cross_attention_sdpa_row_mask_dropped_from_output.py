# Written another way (the bug of huggingface/transformers#39379, as Meta's llama-models CrossAttention masks it): a
# gated cross-attention block over image tokens with SDPA, its config a dict, the image placed at another position in
# each batch row. Text rows before their row's image see no image key: their additive bias rows are all -1e9, so the
# block multiplies the bias by `rows_with_media_mask` (0 on them: uniform weights, no NaN) and must zero those rows'
# output with it. Buggy: the row mask zeroes the feed-forward branch only; the fix multiplies the SDPA output by it too.
import sys

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
CONFIG = {"dim": 32, "n_heads": 2, "ffn_mult": 2}


class CrossAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.n_heads, self.head_dim = config["n_heads"], config["dim"] // config["n_heads"]
        self.wq = nn.Linear(config["dim"], config["dim"], bias=False)
        self.wkv = nn.Linear(config["dim"], 2 * config["dim"], bias=False)
        self.wo = nn.Linear(config["dim"], config["dim"], bias=False)

    def forward(self, x, media, xattn_bias, rows_with_media_mask):
        b, n, _ = x.shape
        q = self.wq(x).view(b, n, self.n_heads, self.head_dim).transpose(1, 2)
        k, v = (t.view(b, media.shape[1], self.n_heads, self.head_dim).transpose(1, 2)
                for t in self.wkv(media).chunk(2, dim=-1))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=xattn_bias)
        if FIXED:
            out = out * rows_with_media_mask
        return self.wo(out.transpose(1, 2).reshape(b, n, -1))


class GatedCrossAttentionBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.attn_norm, self.ffn_norm = nn.LayerNorm(config["dim"]), nn.LayerNorm(config["dim"])
        self.attn = CrossAttention(config)
        self.ffn = nn.Sequential(nn.Linear(config["dim"], config["ffn_mult"] * config["dim"]), nn.SiLU(),
                                 nn.Linear(config["ffn_mult"] * config["dim"], config["dim"]))
        self.gate_attn = nn.Parameter(torch.tensor([0.8]))
        self.gate_ffn = nn.Parameter(torch.tensor([0.6]))

    def forward(self, x, media, xattn_bias, rows_with_media_mask):
        h = x + self.gate_attn.tanh() * self.attn(self.attn_norm(x), media, xattn_bias, rows_with_media_mask)
        ffn = self.ffn(self.ffn_norm(h)) * rows_with_media_mask[:, 0]
        return h + self.gate_ffn.tanh() * ffn


def media_bias(image_at: list[int], n: int, media_len: int):
    """(B, 1, n, media_len) additive bias: text tokens from their row's image token on see the image; the rows before
    it see nothing (-1e9), then unmasked by the row mask ((B, 1, n, 1), 0 on those rows)."""
    seen = torch.arange(n)[None, :] >= torch.tensor(image_at)[:, None]  # (B, n)
    bias = torch.zeros(len(image_at), 1, n, media_len).masked_fill(~seen[:, None, :, None], -1e9)
    row_mask = (bias > -1e9).any(dim=-1, keepdim=True).to(bias.dtype)
    return bias * row_mask, row_mask


block = GatedCrossAttentionBlock(CONFIG).eval()
image_at, n, media_len = [2, 5], 8, 6
bias, row_mask = media_bias(image_at, n, media_len)
x = torch.randn(2, n, CONFIG["dim"])
with torch.no_grad():
    a = block(x, torch.randn(2, media_len, CONFIG["dim"]), bias, row_mask)
    b = block(x, torch.randn(2, media_len, CONFIG["dim"]), bias, row_mask)
print(f"fixed={FIXED} change of batch row 1's tokens before its image: {(a[1, :5] - b[1, :5]).abs().max():.4f}")
