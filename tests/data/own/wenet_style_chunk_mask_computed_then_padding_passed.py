# A WeNet-style streaming conformer (wenet/transformer/encoder.py's BaseEncoder: `static_chunk_size`, a causal
# encoder trained on chunks), written the way a fork wrote it: `add_optional_chunk_mask` builds the chunk mask
# (each frame sees its own chunk and every chunk before it) and-ed with the padding, but the layers are handed the
# padding mask `masks` alone, so a right-padded batch attends over the whole utterance, future chunks included.
# The fix hands them `chunk_masks`. A streaming step of one chunk (4 frames) masks nothing in both: one chunk sees
# itself whole.
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


def make_pad_mask(lengths: torch.Tensor, max_len: int) -> torch.Tensor:
    return torch.arange(max_len)[None, :] >= lengths[:, None]  # True = padding


def subsequent_chunk_mask(size: int, chunk_size: int) -> torch.Tensor:
    ret = torch.zeros(size, size, dtype=torch.bool)
    for i in range(size):
        ending = min((i // chunk_size + 1) * chunk_size, size)
        ret[i, 0:ending] = True
    return ret


def add_optional_chunk_mask(masks: torch.Tensor, static_chunk_size: int) -> torch.Tensor:
    """masks (B, 1, T), True = real; returns (B, T, T), True = may attend."""
    if static_chunk_size > 0:
        chunk = subsequent_chunk_mask(masks.size(-1), static_chunk_size)
        return masks & chunk.unsqueeze(0)
    return masks


class MultiHeadedAttention(nn.Module):
    def __init__(self, n_head: int, n_feat: int):
        super().__init__()
        self.h, self.d_k = n_head, n_feat // n_head
        self.linear_q, self.linear_k = nn.Linear(n_feat, n_feat), nn.Linear(n_feat, n_feat)
        self.linear_v, self.linear_out = nn.Linear(n_feat, n_feat), nn.Linear(n_feat, n_feat)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.linear_q(x).view(b, t, self.h, self.d_k).transpose(1, 2)
        k = self.linear_k(x).view(b, t, self.h, self.d_k).transpose(1, 2)
        v = self.linear_v(x).view(b, t, self.h, self.d_k).transpose(1, 2)
        if mask.size(1) == 1:  # (B, 1, T): a key mask for every query
            mask = mask.expand(b, t, t)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.unsqueeze(1))
        return self.linear_out(out.transpose(1, 2).reshape(b, t, -1))


class ConformerEncoderLayer(nn.Module):
    def __init__(self, size: int, n_head: int):
        super().__init__()
        self.self_attn = MultiHeadedAttention(n_head, size)
        self.norm = nn.LayerNorm(size)
        self.ff = nn.Sequential(nn.Linear(size, 2 * size), nn.SiLU(), nn.Linear(2 * size, size))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.norm(x), mask)
        return x + self.ff(x)


class ConformerEncoder(nn.Module):
    def __init__(self, input_size=10, output_size=16, n_head=2, num_blocks=2, static_chunk_size=4, causal=True):
        super().__init__()
        self.embed = nn.Linear(input_size, output_size)
        self.encoders = nn.ModuleList([ConformerEncoderLayer(output_size, n_head) for _ in range(num_blocks)])
        self.static_chunk_size = static_chunk_size
        self.causal = causal

    def forward(self, xs: torch.Tensor, xs_lens: torch.Tensor):
        t = xs.size(1)
        masks = ~make_pad_mask(xs_lens, t).unsqueeze(1)  # (B, 1, T), True = real
        xs = self.embed(xs)
        chunk_masks = add_optional_chunk_mask(masks, self.static_chunk_size)
        for layer in self.encoders:
            xs = layer(xs, chunk_masks if FIXED else masks)
        return xs, masks


def main():
    torch.manual_seed(0)
    encoder = ConformerEncoder().eval()
    xs = torch.randn(2, 12, 10)
    xs_lens = torch.tensor([12, 9])
    with torch.no_grad():
        full, _ = encoder(xs, xs_lens)  # the whole (padded) utterance, as in training
        first, _ = encoder(xs[:, :4], torch.tensor([4, 4]))  # streaming: the first chunk alone
    diff = (full[:, :4] - first).abs().max().item()
    print(f"fixed={FIXED} first chunk, whole utterance vs streamed: max diff {diff:.3e}")


if __name__ == "__main__":
    main()
