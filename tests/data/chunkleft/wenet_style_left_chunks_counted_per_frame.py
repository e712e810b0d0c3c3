# A WeNet-style streaming encoder (wenet/utils/mask.py's subsequent_chunk_mask(size, chunk_size, num_left_chunks)),
# its chunk config a plain dict handed to forward as `chunk_conf`, attention through SDPA with a bool mask, a
# right-padded batch. The buggy mask counts the left context back from each frame (`i - num_left_chunks *
# chunk_size`), so the frames of one chunk see different pasts and all but its first see less than num_left_chunks
# whole chunks back, where streaming inference caches num_left_chunks whole chunks before the chunk. The fix starts
# every frame of a chunk at the first frame of the chunk num_left_chunks before it.
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


def subsequent_chunk_mask(size: int, chunk_size: int, num_left_chunks: int = -1) -> torch.Tensor:
    ret = torch.zeros(size, size, dtype=torch.bool)
    for i in range(size):
        if num_left_chunks < 0:
            start = 0
        elif FIXED:
            start = max((i // chunk_size - num_left_chunks) * chunk_size, 0)
        else:
            start = max(i - num_left_chunks * chunk_size, 0)
        ending = min((i // chunk_size + 1) * chunk_size, size)
        ret[i, start:ending] = True
    return ret


class SelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None])
        return self.out(y.transpose(1, 2).reshape(b, t, d))


class StreamingEncoder(nn.Module):
    def __init__(self, idim=8, dim=16, heads=2, layers=2):
        super().__init__()
        self.proj = nn.Linear(idim, dim)
        self.blocks = nn.ModuleList([SelfAttention(dim, heads) for _ in range(layers)])

    def forward(self, feats: torch.Tensor, feats_lens: torch.Tensor, chunk_conf: dict):
        t = feats.size(1)
        pad = torch.arange(t)[None, :] < feats_lens[:, None]  # True = a real frame
        chunk = subsequent_chunk_mask(t, chunk_conf["chunk_size"], chunk_conf["num_left_chunks"])
        mask = pad[:, None, :] & chunk[None]  # (B, T, T)
        mask = mask | ~pad[:, :, None] & pad[:, None, :]  # (a padded frame attends to the real ones: no NaN)
        x = self.proj(feats)
        for block in self.blocks:
            x = x + block(x, mask)
        return x


def main():
    torch.manual_seed(0)
    encoder = StreamingEncoder().eval()
    feats = torch.randn(2, 15, 8)
    lens = torch.tensor([15, 11])
    with torch.no_grad():
        out = encoder(feats, lens, {"chunk_size": 3, "num_left_chunks": 2})
    print(f"fixed={FIXED} encoded {tuple(out.shape)}")


if __name__ == "__main__":
    main()
