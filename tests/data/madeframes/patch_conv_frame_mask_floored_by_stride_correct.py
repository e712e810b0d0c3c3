# Correct: an audio encoder whose frames are non-overlapping patches (Conv1d kernel 4, stride 4, no padding), so each
# row's n real samples make exactly n // 4 frames, and the frame mask floored by the stride is the conv's own count
# (a trailing partial patch is never computed). Padding held as a (B, S) `padding_mask` (True = pad); SDPA with a
# bool key mask. --fixed runs the same program.
import torch
import torch.nn.functional as F
from torch import nn


class PatchEncoder(nn.Module):
    def __init__(self, channels: int = 8, dim: int = 32, heads: int = 4, patch: int = 4):
        super().__init__()
        self.patch, self.heads = patch, heads
        self.embed = nn.Conv1d(channels, dim, kernel_size=patch, stride=patch)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, audio: torch.Tensor, padding_mask: torch.Tensor) -> torch.Tensor:
        x = self.embed(audio).transpose(1, 2)  # (B, L, D)
        b, n, d = x.shape
        frame_real = (~padding_mask).sum(-1) // self.patch
        keep = torch.arange(n)[None, :] < frame_real[:, None]  # (B, L) True = a real frame
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None, None, :])
        return self.out(y.transpose(1, 2).reshape(b, n, d))


def main():
    torch.manual_seed(0)
    model = PatchEncoder().eval()
    lengths = torch.tensor([64, 47, 30])
    padding_mask = torch.arange(64)[None, :] >= lengths[:, None]
    audio = torch.randn(3, 8, 64) * ~padding_mask[:, None, :]
    with torch.no_grad():
        print(model(audio, padding_mask).shape)


if __name__ == "__main__":
    main()
