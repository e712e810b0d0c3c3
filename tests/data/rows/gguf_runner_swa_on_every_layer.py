"""A small Python runner for a GGUF-style model whose hyperparameters keep llama.cpp's names.

`hparams` says the standard sliding window (`swa_type` 1) of `n_swa` = 3 keys on the layers `swa_layers` marks
(layers 0 and 2; layers 1 and 3 attend to everything before them). Buggy: the runner builds one kq mask from n_swa
and hands it to every layer. Fixed: a layer's mask slides only where swa_layers[il] is True. Greedy decode of 3
tokens after a 6-token prompt, the cache grown by concatenation.
"""

import sys

import torch
from torch import nn

FIXED = "--fixed" in sys.argv

hparams = {"n_layer": 4, "n_embd": 16, "n_head": 2, "n_vocab": 32, "n_swa": 3, "swa_type": 1,
           "swa_layers": [True, False, True, False]}


def kq_mask(n_tokens, n_kv, swa):
    p1 = torch.arange(n_kv - n_tokens, n_kv)[:, None]
    p0 = torch.arange(n_kv)[None, :]
    masked = p0 > p1
    if swa:
        masked |= p1 - p0 >= hparams["n_swa"]
    return torch.zeros(n_tokens, n_kv).masked_fill(masked, float("-inf"))


class Runner(nn.Module):
    def __init__(self):
        super().__init__()
        d = hparams["n_embd"]
        self.tok = nn.Embedding(hparams["n_vocab"], d)
        self.wqkv = nn.ModuleList([nn.Linear(d, 3 * d) for _ in range(hparams["n_layer"])])
        self.wo = nn.ModuleList([nn.Linear(d, d) for _ in range(hparams["n_layer"])])
        self.out = nn.Linear(d, hparams["n_vocab"])
        self.k = [None] * hparams["n_layer"]
        self.v = [None] * hparams["n_layer"]

    def attend(self, il, x, mask):
        n, d = x.shape
        h = hparams["n_head"]
        q, k, v = self.wqkv[il](x).view(n, 3, h, d // h).permute(1, 2, 0, 3)
        if self.k[il] is not None:
            k, v = torch.cat([self.k[il], k], 1), torch.cat([self.v[il], v], 1)
        self.k[il], self.v[il] = k, v
        w = torch.softmax(q @ k.transpose(-1, -2) / (d // h) ** 0.5 + mask, dim=-1)
        return self.wo[il]((w @ v).transpose(0, 1).reshape(n, d))

    def forward(self, tokens):
        x = self.tok(tokens)
        n_kv = (0 if self.k[0] is None else self.k[0].shape[1]) + len(tokens)
        shared = kq_mask(len(tokens), n_kv, True)
        for il in range(hparams["n_layer"]):
            mask = kq_mask(len(tokens), n_kv, hparams["swa_layers"][il]) if FIXED else shared
            x = x + self.attend(il, x, mask)
        return self.out(x)


def main():
    torch.manual_seed(0)
    runner = Runner().eval()
    tokens = torch.tensor([5, 9, 2, 14, 7, 11])
    out = []
    with torch.no_grad():
        for _ in range(3):
            logits = runner(tokens)
            tokens = logits[-1:].argmax(-1)
            out.append(int(tokens))
    print("generated", out)


if __name__ == "__main__":
    main()
