"""native-sparse-attention-pytorch: the flex sliding-window mask_mod mixes `&` and `>=` without parentheses.

Citation: lucidrains/native-sparse-attention-pytorch commit 8fad00a ("fix flex sliding window
attn", v0.0.78).

Bug: `create_sliding_mask` (used by the Transformer when `use_flex_sliding_window=True`) built
the FlexAttention mask_mod of the sliding-window branch as

    mask = distance <= window_size
    if causal:
        mask = mask & q_idx >= kv_idx

Python binds `&` tighter than `>=`, so this is `(mask & q_idx) >= kv_idx`: the bool window mask
AND-ed bitwise with the integer query index (its lowest bit), then compared with the key index.
Every query keeps key 0 and at most key 1; the window of `sliding_window_size` previous keys is
lost (and a query outside the window of key 0 still sees it).
Fix: `backward_sliding_mask = distance <= window_size`, `forward_sliding_mask = distance >= 0`
(or `>= -window_size` when not causal), returned AND-ed.

This program keeps the Transformer's mask preparation (`create_sliding_mask(seq_len,
self.attn_sliding_window_size, causal=self.causal)` built once per forward and passed down to
every layer as `sliding_window_flex_mask`) and the sliding-window branch of SparseAttention
(`flex_attention(sq, sk, sv, block_mask=sliding_window_flex_mask, enable_gqa=True)`).  The
compressed and fine-selection branches of NSA are left out: they do not touch this mask.
`create_block_mask(..., _compile=True)` and `torch.compile(flex_attention)` are run eagerly
here to stay on CPU and under a few seconds.
"""
import sys
import warnings

import torch
from torch import nn
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

FIXED = "--fixed" in sys.argv

# eager flex_attention on CPU warns that it is unfused
warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")


# flex attn sliding attention mask

def create_sliding_mask(seq_len, window_size, causal=True):
    def sliding_mask(_, __, q_idx, kv_idx):

        distance = q_idx - kv_idx

        if FIXED:
            backward_sliding_mask = distance <= window_size

            forward_distance = 0 if causal else -window_size
            forward_sliding_mask = distance >= forward_distance

            return backward_sliding_mask & forward_sliding_mask

        mask = distance <= window_size

        if causal:
            mask = mask & q_idx >= kv_idx
        else:
            mask = mask & (distance >= -window_size)

        return mask

    block_mask = create_block_mask(sliding_mask, B=None, H=None, Q_LEN=seq_len, KV_LEN=seq_len, _compile=False)
    return block_mask


class SparseAttention(nn.Module):
    """The sliding-window strategy of NSA's SparseAttention (GQA: kv_heads < heads)."""

    def __init__(self, dim, dim_head, heads, sliding_window_size, kv_heads=None, causal=True):
        super().__init__()
        kv_heads = heads if kv_heads is None else kv_heads
        self.heads = heads
        self.kv_heads = kv_heads
        self.num_grouped_queries = heads // kv_heads
        self.dim_head = dim_head
        self.causal = causal
        self.sliding_window_size = sliding_window_size
        self.norm = nn.RMSNorm(dim)
        self.to_qkv = nn.Linear(dim, dim_head * (heads + 2 * kv_heads), bias=False)
        self.qkv_split = (dim_head * heads, dim_head * kv_heads, dim_head * kv_heads)
        self.combine_heads = nn.Linear(dim_head * heads, dim, bias=False)

    def forward(self, inp, sliding_window_flex_mask):
        batch, seq_len, _ = inp.shape
        inp = self.norm(inp)
        q, k, v = self.to_qkv(inp).split(self.qkv_split, dim=-1)
        q = q.view(batch, seq_len, self.heads, self.dim_head).transpose(1, 2)
        k = k.view(batch, seq_len, self.kv_heads, self.dim_head).transpose(1, 2)
        v = v.view(batch, seq_len, self.kv_heads, self.dim_head).transpose(1, 2)

        # overlapping sliding window - `s` for sliding
        sq, sk, sv = q, k, v

        sliding_window_attn_out = flex_attention(sq, sk, sv, block_mask=sliding_window_flex_mask, enable_gqa=True)

        out = sliding_window_attn_out.transpose(1, 2).reshape(batch, seq_len, -1)
        return self.combine_heads(out)


class Transformer(nn.Module):
    def __init__(self, num_tokens, dim, depth, dim_head=16, heads=4, kv_heads=2, causal=True,
                 use_sparse_attn=True, use_flex_sliding_window=False, sparse_attn_kwargs=None):
        super().__init__()
        sparse_attn_kwargs = sparse_attn_kwargs or dict(sliding_window_size=32)
        self.token_emb = nn.Embedding(num_tokens, dim)
        self.causal = causal
        self.use_flex_sliding_window = use_sparse_attn & use_flex_sliding_window
        self.layers = nn.ModuleList([
            nn.ModuleList([
                SparseAttention(dim, dim_head, heads, kv_heads=kv_heads, causal=causal, **sparse_attn_kwargs),
                nn.Sequential(nn.RMSNorm(dim), nn.Linear(dim, dim * 4), nn.GELU(), nn.Linear(dim * 4, dim)),
            ])
            for _ in range(depth)
        ])
        attn = self.layers[0][0]
        self.attn_sliding_window_size = getattr(attn, 'sliding_window_size', None)
        self.norm = nn.RMSNorm(dim)
        self.to_logits = nn.Linear(dim, num_tokens, bias=False)

    def forward(self, ids, disable_flex=False):
        seq_len = ids.shape[-1]
        tokens = self.token_emb(ids)

        # prepare maybe flex attention masks
        sliding_window_flex_mask = None
        if not disable_flex and self.use_flex_sliding_window:
            sliding_window_flex_mask = create_sliding_mask(seq_len, self.attn_sliding_window_size, causal=self.causal)

        for attn, ff in self.layers:
            tokens = attn(tokens, sliding_window_flex_mask=sliding_window_flex_mask) + tokens
            tokens = ff(tokens) + tokens

        return self.to_logits(self.norm(tokens))


def main():
    torch.manual_seed(0)
    model = Transformer(
        num_tokens=256,
        dim=64,
        depth=2,
        use_flex_sliding_window=True,
        sparse_attn_kwargs=dict(sliding_window_size=8),
    ).eval()
    ids = torch.randint(0, 256, (1, 48))
    with torch.no_grad():
        logits = model(ids)
    print("fixed" if FIXED else "buggy", tuple(logits.shape), f"{logits.abs().sum().item():.3f}")


if __name__ == "__main__":
    main()
