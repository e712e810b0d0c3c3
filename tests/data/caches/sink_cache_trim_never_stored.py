# A StreamingLLM-style sink cache (attention sinks + a sliding window, as sink-cache ports write it) whose trim
# computes the kept keys and never stores them back: `keys = torch.cat(...)` rebinds a local, so the cache keeps
# growing and every decode step attends over the whole history. A left-padded batch of two, eager softmax with an
# additive padding bias held beside the keys. --fixed stores the trimmed keys, values and padding on the cache.
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv


class SinkCache:
    def __init__(self, sliding_window, num_sink_tokens):
        self.sliding_window = sliding_window
        self.num_sink_tokens = num_sink_tokens
        self.keys = self.values = self.bias = None

    def add(self, k, v, bias):
        if self.keys is None:
            self.keys, self.values, self.bias = k, v, bias
        else:
            self.keys = torch.cat([self.keys, k], dim=2)
            self.values = torch.cat([self.values, v], dim=2)
            self.bias = torch.cat([self.bias, bias], dim=-1)
        self._trim()

    def _trim(self):
        s, w = self.num_sink_tokens, self.sliding_window
        if self.keys.shape[2] <= s + w:
            return
        keys = torch.cat([self.keys[:, :, :s], self.keys[:, :, -w:]], dim=2)
        values = torch.cat([self.values[:, :, :s], self.values[:, :, -w:]], dim=2)
        bias = torch.cat([self.bias[..., :s], self.bias[..., -w:]], dim=-1)
        if FIXED:
            self.keys, self.values, self.bias = keys, values, bias

    def attention(self, q, causal):
        scores = q @ self.keys.transpose(-1, -2) / q.shape[-1] ** 0.5
        scores = scores + self.bias[:, None, None, :] + causal
        return torch.softmax(scores, dim=-1) @ self.values


class Layer(nn.Module):
    def __init__(self, hidden=16, heads=2):
        super().__init__()
        self.heads, self.hd = heads, hidden // heads
        self.q = nn.Linear(hidden, hidden)
        self.kv = nn.Linear(hidden, 2 * hidden)

    def forward(self, x, cache, bias, causal):
        b, t, _ = x.shape
        q = self.q(x).view(b, t, self.heads, self.hd).transpose(1, 2)
        k, v = self.kv(x).view(b, t, 2, self.heads, self.hd).permute(2, 0, 3, 1, 4)
        cache.add(k, v, bias)
        return cache.attention(q, causal).transpose(1, 2).reshape(b, t, -1)


def main():
    torch.manual_seed(0)
    layer = Layer().eval()
    cache = SinkCache(sliding_window=4, num_sink_tokens=2)
    prompt = torch.randn(2, 3, 16)
    pad = torch.tensor([[False, False, False], [True, False, False]])  # row 1 left-padded by one token
    bias = torch.zeros(2, 3).masked_fill(pad, torch.finfo(torch.float32).min)
    causal = torch.full((3, 3), float("-inf")).triu(1)
    with torch.no_grad():
        layer(prompt, cache, bias, causal)
        for _ in range(8):
            x = torch.randn(2, 1, 16)
            layer(x, cache, torch.zeros(2, 1), 0.0)  # (one query: it sees every cached key)
    print(f"fixed={FIXED} cached keys={cache.keys.shape[2]}")


if __name__ == "__main__":
    main()
