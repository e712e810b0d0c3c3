"""A sliding-window layer whose attention function is handed FlashAttention's window_size=(3, 0), left-padded batch,
eager softmax: the prompt pass masks the window, the single-query decode path masks the padding alone and attends
the whole cache (--fixed: the window on that path too)."""
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv


def attend(q, k, v, real, window_size):
    """real: (B, Lk) 1 = a real key; window_size = (left, right) as flash_attn takes it."""
    q_len, k_len = q.shape[2], k.shape[2]
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    rows = torch.arange(k_len - q_len, k_len)[:, None]
    cols = torch.arange(k_len)[None, :]
    keep = real.bool()[:, None, None, :]
    if q_len > 1 or FIXED:
        keep = keep & (cols <= rows) & (cols >= rows - window_size[0])
    scores = scores.masked_fill(~keep, torch.finfo(scores.dtype).min)  # (a padding row: uniform, no NaN)
    weights = torch.softmax(scores, dim=-1)
    return weights @ v


class SlidingLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(20, 16)
        self.qkv = nn.Linear(16, 48)
        self.out = nn.Linear(16, 20)
        self.window = (3, 0)

    def forward(self, input_ids, attention_mask, cache=None):
        x = self.embed(input_ids)
        q, k, v = (t.view(*x.shape[:2], 2, 8).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        if cache is not None:
            k, v = torch.cat([cache[0], k], 2), torch.cat([cache[1], v], 2)
        y = attend(q, k, v, attention_mask, self.window)
        return self.out(y.transpose(1, 2).flatten(2)), (k, v)


def main():
    torch.manual_seed(0)
    model = SlidingLM().eval()
    ids = torch.tensor([[0, 0, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12]])
    real = (ids != 0).long()
    with torch.no_grad():
        logits, cache = model(ids, real)
        for _ in range(3):
            nxt = logits[:, -1:].argmax(-1)
            real = torch.cat([real, torch.ones_like(nxt)], 1)
            logits, cache = model(nxt, real, cache)
    print("last", logits[:, -1].argmax(-1).tolist())


if __name__ == "__main__":
    main()
