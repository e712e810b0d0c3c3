"""AllenNLP-style attention: softmax over all keys, then multiply by the padding mask and renormalise (correct)."""
import torch
from torch import nn


def masked_softmax(vector, mask, dim=-1):
    result = torch.nn.functional.softmax(vector * mask, dim=dim)
    result = result * mask
    result = result / (result.sum(dim=dim, keepdim=True) + 1e-13)
    return result


class Attention(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.q = nn.Linear(d, d)
        self.k = nn.Linear(d, d)
        self.v = nn.Linear(d, d)

    def forward(self, x, mask):
        scores = self.q(x) @ self.k(x).transpose(-1, -2) / 4.0
        weights = masked_softmax(scores, mask[:, None, :].float())
        return weights @ self.v(x)


def main():
    torch.manual_seed(0)
    x = torch.randn(2, 6, 16)
    lengths = torch.tensor([6, 4])
    mask = torch.arange(6)[None, :] < lengths[:, None]
    with torch.no_grad():
        out = Attention().eval()(x, mask)
    print(tuple(out.shape))


if __name__ == "__main__":
    main()
