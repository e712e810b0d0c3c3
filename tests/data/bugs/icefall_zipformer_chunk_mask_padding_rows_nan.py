"""icefall Zipformer: chunk-wise mask plus key padding leaves padded rows fully masked (NaN).

Citation: k2-fsa/icefall#774 "Fix zipformer attn_output_weights" (merged, commit 65d7192).
In egs/librispeech/ASR/pruned_transducer_stateless7/zipformer.py, ``RelPositionMultiheadAttention``
adds the chunk-wise streaming ``attn_mask`` (``~subsequent_chunk_mask(..., num_left_chunks)``, True =
masked) and then the ``key_padding_mask`` (True = padding) to ``attn_output_weights`` before the softmax.
With a limited ``num_left_chunks``, a padded frame of a short utterance can only see chunks that are all
padding: its whole row is -inf, the softmax gives NaN, and the NaN frames become values for the real
frames of the next layer (a NaN loss in dynamic-chunk training).

Fix: after the softmax, fill 0.0 at the positions masked by ``attn_mask | key_padding_mask`` (and use
out-of-place ops), "as we did in our conformer recipes".

This program: the attention as icefall writes it ((seq_len, batch, embed) layout, weights of shape
(bsz * num_heads, seq_len, seq_len), a bool chunk mask and a bool key padding mask filled with -inf,
icefall's softmax), two stacked layers, chunk_size 2 with num_left_chunks 1, utterances of 12 and 5
frames. The relative-position term of the scores is left out. Buggy: frames 8..11 of the short utterance
see only padding, their rows are NaN and the next layer's real frames turn NaN; ``--fixed``: those rows
are 0 and every real frame stays finite.
"""
import sys

import torch
from torch import Tensor, nn

FIXED = "--fixed" in sys.argv


def subsequent_chunk_mask(size: int, chunk_size: int, num_left_chunks: int = -1) -> Tensor:
    ret = torch.zeros(size, size, dtype=torch.bool)
    for i in range(size):
        if num_left_chunks < 0:
            start = 0
        else:
            start = max((i // chunk_size - num_left_chunks) * chunk_size, 0)
        ending = min((i // chunk_size + 1) * chunk_size, size)
        ret[i, start:ending] = True
    return ret


def make_pad_mask(lengths: Tensor, max_len: int = 0) -> Tensor:
    max_len = max(max_len, int(lengths.max()))
    return torch.arange(max_len).expand(lengths.size(0), max_len) >= lengths.unsqueeze(-1)


class RelPositionMultiheadAttention(nn.Module):
    def __init__(self, embed_dim: int, num_heads: int):
        super().__init__()
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.in_proj = nn.Linear(embed_dim, 3 * embed_dim)
        self.out_proj = nn.Linear(embed_dim, embed_dim)

    def forward(self, x: Tensor, attn_mask: Tensor = None, key_padding_mask: Tensor = None) -> Tensor:
        seq_len, bsz, _ = x.shape
        num_heads, head_dim = self.num_heads, self.head_dim
        q, k, v = self.in_proj(x).chunk(3, dim=-1)
        q = q.reshape(seq_len, bsz * num_heads, head_dim).transpose(0, 1) * head_dim**-0.5
        k = k.reshape(seq_len, bsz * num_heads, head_dim).transpose(0, 1)
        v = v.reshape(seq_len, bsz * num_heads, head_dim).transpose(0, 1)

        attn_output_weights = torch.bmm(q, k.transpose(1, 2))  # (bsz * num_heads, seq_len, seq_len)

        if attn_mask is not None:
            if attn_mask.dtype == torch.bool:
                attn_output_weights = attn_output_weights.masked_fill(attn_mask, float("-inf"))
            else:
                attn_output_weights = attn_output_weights + attn_mask

        if key_padding_mask is not None:
            attn_output_weights = attn_output_weights.view(bsz, num_heads, seq_len, seq_len)
            attn_output_weights = attn_output_weights.masked_fill(
                key_padding_mask.unsqueeze(1).unsqueeze(2), float("-inf")
            )
            attn_output_weights = attn_output_weights.view(bsz * num_heads, seq_len, seq_len)

        attn_output_weights = attn_output_weights.softmax(dim=-1)

        if FIXED and attn_mask is not None and attn_mask.dtype == torch.bool and key_padding_mask is not None:
            # rows that see only padding under a limited num_left_chunks are NaN: zero what is masked
            combined_mask = attn_mask.unsqueeze(0) | key_padding_mask.unsqueeze(1).unsqueeze(2)
            attn_output_weights = attn_output_weights.view(bsz, num_heads, seq_len, seq_len)
            attn_output_weights = attn_output_weights.masked_fill(combined_mask, 0.0)
            attn_output_weights = attn_output_weights.view(bsz * num_heads, seq_len, seq_len)

        attn_output = torch.bmm(attn_output_weights, v)
        attn_output = attn_output.transpose(0, 1).reshape(seq_len, bsz, self.embed_dim)
        return self.out_proj(attn_output)


def main():
    torch.manual_seed(0)
    embed_dim, num_heads = 32, 4
    layers = nn.ModuleList(RelPositionMultiheadAttention(embed_dim, num_heads) for _ in range(2)).eval()
    x_lens = torch.tensor([12, 5])
    x = torch.randn(12, 2, embed_dim)  # (seq_len, batch, embed), after Conv2dSubsampling
    src_key_padding_mask = make_pad_mask(x_lens)
    # dynamic-chunk training drew chunk_size 2 and num_left_chunks 1 for this batch
    attn_mask = ~subsequent_chunk_mask(size=x.size(0), chunk_size=2, num_left_chunks=1)
    with torch.no_grad():
        for layer in layers:
            x = x + layer(x, attn_mask=attn_mask, key_padding_mask=src_key_padding_mask)
    real = x[:5, 1]
    print("short utterance real frames finite:", bool(torch.isfinite(real).all()))


if __name__ == "__main__":
    main()
