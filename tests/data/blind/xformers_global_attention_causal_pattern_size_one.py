# facebookresearch/xformers#1135: GlobalAttention(causal=True) ANDs causal_1d_pattern(attention_query_mask.shape[1]);
# the query mask is N x 1, so the causal pattern is 1 x 1 and broadcasting leaves the mask non-causal.
import math
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv


def causal_1d_pattern(attn_size: int) -> torch.Tensor:
    mask = torch.tril(torch.ones(attn_size, attn_size, dtype=torch.bool))
    return mask


def global_token_pattern(attention_query_mask: torch.Tensor) -> torch.Tensor:
    assert attention_query_mask.ndim == 1
    assert attention_query_mask.dtype == torch.bool
    attention_query_mask = attention_query_mask[None, :]
    mask = attention_query_mask | attention_query_mask.transpose(1, 0)
    return mask


def scaled_dot_product_attention(q, k, v, att_mask=None, dropout=None):
    att = q @ k.transpose(-2, -1) / math.sqrt(k.size(-1))
    if att_mask is not None:
        att = att.masked_fill(~att_mask, float("-inf"))
    att = torch.softmax(att, dim=-1)
    if dropout is not None:
        att = dropout(att)
    return att @ v


class GlobalAttention(nn.Module):
    def __init__(self, dropout: float, attention_query_mask: torch.Tensor, causal: bool = False):
        """Queries marked True in `attention_query_mask` attend to (and are attended by) all the others."""
        super().__init__()
        assert attention_query_mask.dtype == torch.bool, "A boolean mask is expected"
        assert (
            attention_query_mask.shape[1] == 1
            and attention_query_mask.shape[0] > attention_query_mask.shape[1]
        ), "A N x 1 query mask is expected"

        self.attn_drop = nn.Dropout(dropout, inplace=False)
        self.attention_mask = global_token_pattern(attention_query_mask[:, 0])

        if causal:
            size = attention_query_mask.shape[0] if FIXED else attention_query_mask.shape[1]
            self.attention_mask &= causal_1d_pattern(size)

    def forward(self, q, k, v, att_mask=None):
        mask = self.attention_mask if att_mask is None else self.attention_mask & att_mask
        return scaled_dot_product_attention(q, k, v, att_mask=mask, dropout=self.attn_drop)


class Block(nn.Module):
    """A small decoder block: qkv projection, global (causal) attention, output projection."""

    def __init__(self, dim, heads, attention):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.attention = attention

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = self.attention(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1))
        y = y.view(b, self.heads, n, d // self.heads).transpose(1, 2).reshape(b, n, d)
        return x + self.proj(y)


def main():
    torch.manual_seed(0)
    seq, dim = 16, 32
    attention_query_mask = torch.zeros(seq, 1, dtype=torch.bool)
    attention_query_mask[0] = True   # a CLS-like global token
    attention_query_mask[8] = True   # and one in the middle
    block = Block(dim, 4, GlobalAttention(dropout=0.0, attention_query_mask=attention_query_mask, causal=True)).eval()
    x = torch.randn(2, seq, dim)
    with torch.no_grad():
        full = block(x)
        x2 = x.clone()
        x2[:, 10:] = torch.randn_like(x2[:, 10:])  # change only the future of position 9
        changed = block(x2)
    leak = (full[:, :10] - changed[:, :10]).abs().max().item()
    print(f"max change at positions 0..9 after changing tokens 10..: {leak:.4f}")


if __name__ == "__main__":
    main()
