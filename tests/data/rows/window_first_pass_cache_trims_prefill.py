"""A hand-written local-attention decoder whose config is a dict (`self.cfg`, sliding_window 3) and whose cache keeps
the last 3 keys of every pass, the prompt's included: a right-padded batch of 2 prompts (7 and 5 real tokens) is
prefilled in one pass over those 3 keys, so every query but the last ones of the row sees fewer keys than its window
(most see none). --fixed: the prompt pass attends all of its keys under the windowed causal mask and the cache is trimmed after."""
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv


class LocalSelfAttention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.qkv = nn.Linear(cfg["dim"], 3 * cfg["dim"])

    def forward(self, x, keep_tokens, cache):
        b, t, d = x.shape
        h = self.cfg["heads"]
        q, k, v = (y.view(b, t, h, -1).transpose(1, 2) for y in self.qkv(x).chunk(3, -1))
        w = self.cfg["sliding_window"]
        qpos = torch.arange(t)[:, None]
        kpos = torch.arange(t)[None, :]
        keep = (kpos <= qpos) & (qpos - kpos < w) & keep_tokens.bool()[:, None, None, :]
        if not FIXED:  # the cache's window taken on the prompt pass too: keys and mask cut to the last w columns
            k, v, keep = k[:, :, -w:], v[:, :, -w:], keep[..., -w:]
        cache["k"], cache["v"] = k[:, :, -w:], v[:, :, -w:]
        scores = (q @ k.transpose(-1, -2)) / (d // h) ** 0.5
        weights = torch.softmax(scores.masked_fill(~keep, -1e9), dim=-1)
        return (weights @ v).transpose(1, 2).reshape(b, t, d)


class TinyLocalLM(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg["vocab"], cfg["dim"])
        self.self_attention = LocalSelfAttention(cfg)
        self.head = nn.Linear(cfg["dim"], cfg["vocab"])

    def forward(self, input_ids, attention_mask, cache):
        h = self.embed(input_ids)
        return self.head(h + self.self_attention(h, attention_mask, cache))


def main():
    torch.manual_seed(0)
    cfg = {"vocab": 40, "dim": 16, "heads": 2, "sliding_window": 3}
    model = TinyLocalLM(cfg).eval()
    input_ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11], [12, 13, 14, 15, 16, 0, 0]])
    attention_mask = (input_ids != 0).long()
    with torch.no_grad():
        logits = model(input_ids, attention_mask, {})
    print("prompt logits sum %.4f" % logits.sum().item())


if __name__ == "__main__":
    main()
