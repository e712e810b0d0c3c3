"""ESPnet2 transducer encoder: chunk mask and padding mask combined with AND instead of OR.

Citation: espnet/espnet#4751 ("chunk_mask error"), fix in
``espnet2/asr_transducer/encoder/modules/attention.py``.

Bug: ``RelPositionMultiHeadedAttention.forward_attention`` receives the source mask (B, T_2), True = padded
frame, and the streaming chunk mask (T_1, T_2), True = outside the allowed chunks, both meaning "mask out"
for ``masked_fill``, and combines them with ``mask = chunk_mask.unsqueeze(0).unsqueeze(1) & mask``: a
key is masked only when it is both padding and outside the chunk. Valid frames of future chunks become
visible (the encoder is no longer streaming) and padded frames inside the chunk are attended.
Fix: ``chunk_mask.unsqueeze(0).unsqueeze(1) | mask``.

This program: the Conformer encoder's attention with relative positional encoding (rel_shift as in
ESPnet), ``make_source_mask`` / ``make_chunk_mask`` as the encoder builds them with ``short_chunk_size=2``
(fixed-size chunks at training), on a batch of feature lengths [6, 4] of 6.
"""
import math
import sys
from typing import Optional

import torch

FIXED = "--fixed" in sys.argv


def make_source_mask(lengths: torch.Tensor) -> torch.Tensor:
    """Create source mask for given lengths. (B, T_max), True = padding."""
    max_len = lengths.max()
    batch_size = lengths.size(0)
    expanded_lengths = torch.arange(max_len).expand(batch_size, max_len)
    return expanded_lengths >= lengths.unsqueeze(1)


def make_chunk_mask(size: int, chunk_size: int, left_chunk_size: int = 0) -> torch.Tensor:
    """Create chunk mask for the subsequent steps (size, size), True = not attendable."""
    mask = torch.zeros(size, size, dtype=torch.bool)
    for i in range(size):
        if left_chunk_size <= 0:
            start = 0
        else:
            start = max((i // chunk_size - left_chunk_size) * chunk_size, 0)
        end = min((i // chunk_size + 1) * chunk_size, size)
        mask[i, start:end] = True
    return ~mask


class RelPositionalEncoding(torch.nn.Module):
    def __init__(self, size: int):
        super().__init__()
        self.size = size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time = x.size(1)
        positions = torch.arange(time - 1, -time, -1.0).unsqueeze(1)
        div_term = torch.exp(torch.arange(0, self.size, 2) * -(math.log(10000.0) / self.size))
        pe = torch.zeros(2 * time - 1, self.size)
        pe[:, 0::2], pe[:, 1::2] = torch.sin(positions * div_term), torch.cos(positions * div_term)
        return pe.unsqueeze(0)


class RelPositionMultiHeadedAttention(torch.nn.Module):
    def __init__(self, num_heads: int, embed_size: int) -> None:
        super().__init__()
        self.d_k = embed_size // num_heads
        self.num_heads = num_heads
        self.linear_q = torch.nn.Linear(embed_size, embed_size)
        self.linear_k = torch.nn.Linear(embed_size, embed_size)
        self.linear_v = torch.nn.Linear(embed_size, embed_size)
        self.linear_out = torch.nn.Linear(embed_size, embed_size)
        self.linear_pos = torch.nn.Linear(embed_size, embed_size, bias=False)
        self.pos_bias_u = torch.nn.Parameter(torch.randn(num_heads, self.d_k) * 0.1)
        self.pos_bias_v = torch.nn.Parameter(torch.randn(num_heads, self.d_k) * 0.1)

    def rel_shift(self, x: torch.Tensor, left_context: int = 0) -> torch.Tensor:
        batch_size, n_heads, time1, n = x.shape
        time2 = time1 + left_context
        batch_stride, n_heads_stride, time1_stride, n_stride = x.stride()
        return x.as_strided(
            (batch_size, n_heads, time1, time2),
            (batch_stride, n_heads_stride, time1_stride - n_stride, n_stride),
            storage_offset=(n_stride * (time1 - 1)),
        )

    def forward_attention(self, value, scores, mask, chunk_mask: Optional[torch.Tensor] = None):
        batch_size = scores.size(0)
        mask = mask.unsqueeze(1).unsqueeze(2)
        if chunk_mask is not None:
            if FIXED:
                mask = chunk_mask.unsqueeze(0).unsqueeze(1) | mask
            else:
                mask = chunk_mask.unsqueeze(0).unsqueeze(1) & mask
        scores = scores.masked_fill(mask, float("-inf"))
        self.attn = torch.softmax(scores, dim=-1).masked_fill(mask, 0.0)
        attn_output = torch.matmul(self.attn, value)
        return self.linear_out(attn_output.transpose(1, 2).contiguous().view(batch_size, -1, self.num_heads * self.d_k))

    def forward(self, query, key, value, pos_enc, mask, chunk_mask=None, left_context: int = 0):
        n_batch = query.size(0)
        q = self.linear_q(query).view(n_batch, -1, self.num_heads, self.d_k)
        k = self.linear_k(key).view(n_batch, -1, self.num_heads, self.d_k).transpose(1, 2)
        v = self.linear_v(value).view(n_batch, -1, self.num_heads, self.d_k).transpose(1, 2)
        p = self.linear_pos(pos_enc).view(pos_enc.size(0), -1, self.num_heads, self.d_k)
        q_with_bias_u = (q + self.pos_bias_u).transpose(1, 2)
        q_with_bias_v = (q + self.pos_bias_v).transpose(1, 2)
        matrix_ac = torch.matmul(q_with_bias_u, k.transpose(-2, -1))
        matrix_bd = torch.matmul(q_with_bias_v, p.permute(0, 2, 3, 1))
        matrix_bd = self.rel_shift(matrix_bd, left_context=left_context)
        scores = (matrix_ac + matrix_bd) / math.sqrt(self.d_k)
        return self.forward_attention(v, scores, mask, chunk_mask=chunk_mask)


class Encoder(torch.nn.Module):
    def __init__(self, size=16, num_heads=2, dynamic_chunk_training=False, short_chunk_size=2, left_chunk_size=0):
        super().__init__()
        self.pos_enc = RelPositionalEncoding(size)
        self.self_att = RelPositionMultiHeadedAttention(num_heads, size)
        self.dynamic_chunk_training = dynamic_chunk_training
        self.short_chunk_size = short_chunk_size
        self.left_chunk_size = left_chunk_size

    def forward(self, x: torch.Tensor, x_len: torch.Tensor):
        pos_enc = self.pos_enc(x)
        mask = make_source_mask(x_len)
        chunk_mask = None
        if self.short_chunk_size > 0:
            chunk_mask = make_chunk_mask(x.size(1), self.short_chunk_size, left_chunk_size=self.left_chunk_size)
        x = x + self.self_att(x, x, x, pos_enc, mask, chunk_mask=chunk_mask)
        return x, x_len


def main():
    torch.manual_seed(0)
    encoder = Encoder().eval()
    x_len = torch.tensor([6, 4])
    x = torch.randn(2, 6, 16)
    with torch.no_grad():
        out, _ = encoder(x, x_len)
    print("encoder out", tuple(out.shape), "utt-0 first chunk sum %.5f" % out[0, :2].abs().sum())


if __name__ == "__main__":
    main()
