"""A bidirectional encoder served over a ragged batch packed with no padding: one softmax per request, longest first.

`lengths` (3 requests: 9, 5, 7 tokens) are the packed stream's request lengths, not a padded batch's: each request's
call has exactly its own keys, so there is no padding for any mask to keep to (the heads, 3 of them, sit on the call's
batch axis as many as the requests). Correct: no finding.
"""
import torch
import torch.nn as nn


class Encoder(nn.Module):
    def __init__(self, dim=12, heads=3):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)

    def forward(self, tokens, lengths):
        out, start = [], 0
        for n in lengths.tolist():
            x = tokens[start:start + n]
            q, k, v = self.qkv(x).view(n, 3, self.heads, -1).permute(1, 2, 0, 3)  # each (heads, n, d)
            scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5  # (heads, n, n)
            out.append((torch.softmax(scores, dim=-1) @ v).transpose(0, 1).reshape(n, -1))
            start += n
        return torch.cat(out)


def main():
    torch.manual_seed(0)
    lengths = torch.tensor([9, 5, 7])
    model = Encoder().eval()
    with torch.no_grad():
        out = model(torch.randn(int(lengths.sum()), 12), lengths)
    print(out.shape)


if __name__ == "__main__":
    main()
