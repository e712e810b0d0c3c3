"""Cross-attention: `lengths` are the decoder's (queries') lengths; the memory is unpadded, so the kernel gets no
mask over keys (correct). The query padding is dropped from the output afterwards. The memory is as long as
the longest decoder row, so the lengths fit the keys too."""
import torch
import torch.nn.functional as F
from torch import nn


class CrossAttention(nn.Module):
    def __init__(self, d=16, h=2):
        super().__init__()
        self.h = h
        self.q = nn.Linear(d, d)
        self.kv = nn.Linear(d, 2 * d)

    def forward(self, x, memory, lengths):
        b, t, d = x.shape
        s = memory.shape[1]
        q = self.q(x).view(b, t, self.h, -1).transpose(1, 2)
        k, v = self.kv(memory).view(b, s, 2, self.h, -1).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v)
        padding_mask = torch.arange(t)[None, :] < lengths[:, None]
        return out.transpose(1, 2).reshape(b, t, d) * padding_mask[..., None]


def main():
    torch.manual_seed(0)
    x = torch.randn(2, 5, 16)
    memory = torch.randn(2, 5, 16)
    with torch.no_grad():
        out = CrossAttention().eval()(x, memory, torch.tensor([5, 3]))
    print(tuple(out.shape))


if __name__ == "__main__":
    main()
