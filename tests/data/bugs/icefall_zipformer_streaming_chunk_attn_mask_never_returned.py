# k2-fsa/icefall commit 8ccd06105 ("Fix bug where attn_mask was not passed in"):
# Zipformer._get_attn_mask built the chunked, limited-left-context mask for causal training but had no
# `return`, so every layer got attn_mask=None and attended to the whole utterance.
import logging
import sys

import torch
import torch.nn as nn
from torch import Tensor

FIXED = "--fixed" in sys.argv


def make_pad_mask(lengths: Tensor) -> Tensor:
    max_len = int(lengths.max())
    n = lengths.size(0)
    expaned_lengths = torch.arange(max_len).expand(n, max_len)
    return expaned_lengths >= lengths.unsqueeze(1)


class RelPositionMultiheadAttentionWeights(nn.Module):
    def __init__(self, embed_dim: int, num_heads: int, query_head_dim: int):
        super().__init__()
        self.num_heads = num_heads
        self.query_head_dim = query_head_dim
        self.in_proj = nn.Linear(embed_dim, 2 * num_heads * query_head_dim)

    def forward(self, x: Tensor, key_padding_mask=None, attn_mask=None) -> Tensor:
        seq_len, batch_size, _ = x.shape
        num_heads, d = self.num_heads, self.query_head_dim
        q, k = self.in_proj(x).chunk(2, dim=-1)
        q = q.reshape(seq_len, batch_size, num_heads, d).permute(2, 1, 0, 3)
        k = k.reshape(seq_len, batch_size, num_heads, d).permute(2, 1, 3, 0)
        attn_scores = torch.matmul(q, k) / d ** 0.5
        assert attn_scores.shape == (num_heads, batch_size, seq_len, seq_len)
        if attn_mask is not None:
            assert attn_mask.dtype == torch.bool
            attn_scores.masked_fill_(attn_mask, float("-inf"))
        if key_padding_mask is not None:
            attn_scores = attn_scores.masked_fill(key_padding_mask.unsqueeze(1), float("-inf"))
        return attn_scores.softmax(dim=-1)


class ZipformerEncoderLayer(nn.Module):
    def __init__(self, embed_dim: int, num_heads: int):
        super().__init__()
        self.self_attn_weights = RelPositionMultiheadAttentionWeights(embed_dim, num_heads, 8)
        self.value = nn.Linear(embed_dim, embed_dim)
        self.out_proj = nn.Linear(embed_dim, embed_dim)
        self.feed_forward = nn.Sequential(nn.Linear(embed_dim, 64), nn.SiLU(), nn.Linear(64, embed_dim))
        self.num_heads = num_heads

    def forward(self, src: Tensor, src_key_padding_mask=None, attn_mask=None) -> Tensor:
        T, B, C = src.shape
        w = self.self_attn_weights(src, key_padding_mask=src_key_padding_mask, attn_mask=attn_mask)
        v = self.value(src).reshape(T, B, self.num_heads, -1).permute(2, 1, 0, 3)
        out = torch.matmul(w, v).permute(2, 1, 0, 3).reshape(T, B, C)
        src = src + self.out_proj(out)
        return src + self.feed_forward(src)


class Zipformer(nn.Module):
    def __init__(self, num_features=16, encoder_dim=32, num_layers=2, causal=True,
                 chunk_size=(8,), left_context_frames=(16,)):
        super().__init__()
        self.encoder_embed = nn.Linear(num_features, encoder_dim)
        self.layers = nn.ModuleList([ZipformerEncoderLayer(encoder_dim, 4) for _ in range(num_layers)])
        self.causal = causal
        self.chunk_size = chunk_size
        self.left_context_frames = left_context_frames

    def get_chunk_info(self):
        if not self.causal:
            return -1, -1
        chunk_size = self.chunk_size[0]
        left_context_chunks = self.left_context_frames[0] // chunk_size
        return chunk_size, left_context_chunks

    def _get_attn_mask(self, x: Tensor, chunk_size: int, left_context_chunks: int):
        """Return None if chunk_size == -1, else attention mask of shape (seq_len, seq_len).
        True means a masked position."""
        if chunk_size <= 0:
            return None
        seq_len = x.shape[0]
        t = torch.arange(seq_len, dtype=torch.int32)
        c = t // chunk_size
        src_c = c
        tgt_c = c.unsqueeze(-1)
        attn_mask = torch.logical_or(src_c > tgt_c, src_c < tgt_c - left_context_chunks)
        if __name__ == "__main__":
            logging.info(f"attn_mask = {attn_mask}")
        if FIXED:
            return attn_mask

    def forward(self, x: Tensor, x_lens: Tensor):
        x = self.encoder_embed(x)
        x = x.permute(1, 0, 2)  # (N, T, C) -> (T, N, C)
        src_key_padding_mask = make_pad_mask(x_lens)
        chunk_size, left_context_chunks = self.get_chunk_info()
        attn_mask = self._get_attn_mask(x, chunk_size, left_context_chunks)
        for layer in self.layers:
            x = layer(x, src_key_padding_mask=src_key_padding_mask, attn_mask=attn_mask)
        return x.permute(1, 0, 2), x_lens


def main():
    torch.manual_seed(0)
    model = Zipformer()
    model.train()
    feats = torch.randn(2, 40, 16)
    feat_lens = torch.tensor([40, 29])
    out, _ = model(feats, feat_lens)  # causal (streaming) training forward
    # What a streaming decoder sees for the first chunk: only the first 8 frames exist yet.
    with torch.no_grad():
        first, _ = model(feats[:, :8], torch.tensor([8, 8]))
    diff = (out[:, :8] - first).abs().max().item()
    print(f"fixed={FIXED} first-chunk output, full-utterance training vs streaming: max diff {diff:.3e}")


if __name__ == "__main__":
    main()
