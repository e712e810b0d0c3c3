"""A ModernBERT-style encoder: a dict config on `self.cfg` lists local (sliding) and global layers; the local layers
see `|q - k| <= W` both ways, but the global layer's mask is built causal (a decoder's helper reused), on a
right-padded batch; --fixed: the global layer sees every real key."""

import sys

import torch

FIXED = "--fixed" in sys.argv


def local_mask(padding, window):
    pos = torch.arange(padding.shape[1])
    band = (pos[:, None] - pos[None, :]).abs() <= window
    return band[None] & padding[:, None, :].bool()


def global_mask(padding):
    keep = padding[:, None, :].bool().expand(-1, padding.shape[1], -1)
    return keep if FIXED else keep & torch.ones(keep.shape[-2:], dtype=torch.bool).tril()


class Layer(torch.nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.qkv = torch.nn.Linear(dim, 3 * dim)

    def forward(self, x, keep):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        scores = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
        weights = scores.masked_fill(~keep, torch.finfo(scores.dtype).min).softmax(dim=-1)
        return x + weights @ v


class Encoder(torch.nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.embed = torch.nn.Embedding(cfg["vocab_size"], cfg["hidden_size"])
        self.layers = torch.nn.ModuleList(Layer(cfg["hidden_size"]) for _ in cfg["layer_types"])

    def forward(self, input_ids, attention_mask):
        x = self.embed(input_ids)
        masks = {"sliding_attention": local_mask(attention_mask, self.cfg["sliding_window"]),
                 "full_attention": global_mask(attention_mask)}
        for kind, layer in zip(self.cfg["layer_types"], self.layers):
            x = layer(x, masks[kind])
        return x


if __name__ == "__main__":
    torch.manual_seed(0)
    cfg = {"vocab_size": 30, "hidden_size": 8, "sliding_window": 2,
           "layer_types": ["full_attention", "sliding_attention", "sliding_attention"]}
    model = Encoder(cfg).eval()
    ids = torch.randint(1, 30, (2, 9))
    padding = torch.ones(2, 9, dtype=torch.long)
    padding[1, 6:] = 0
    with torch.no_grad():
        out = model(ids, padding)
    print("states", tuple(out.shape))
