# A static KV buffer of 16 cells, every layer's attention one line in a loop (as llama.cpp's graph runs them): the
# prompt's layers share one mask, cells past the written ones are empty. Buggy: the decode step's mask is built from
# the query's row number (j <= i), not its position, so the new token sees cell 0 only. Fixed: from its position.
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
N_CTX, D, HEADS, LAYERS = 16, 8, 2, 3


class Context(nn.Module):
    def __init__(self):
        super().__init__()
        self.wq = nn.ModuleList(nn.Linear(D, D, bias=False) for _ in range(LAYERS))
        self.wk = nn.ModuleList(nn.Linear(D, D, bias=False) for _ in range(LAYERS))
        self.wv = nn.ModuleList(nn.Linear(D, D, bias=False) for _ in range(LAYERS))
        self.k_buf = [torch.zeros(N_CTX, D) for _ in range(LAYERS)]
        self.v_buf = [torch.zeros(N_CTX, D) for _ in range(LAYERS)]
        self.cell_pos = torch.full((N_CTX,), -1)

    def kq_mask(self, pos):
        mask = torch.full((len(pos), N_CTX), float("-inf"))
        for i, p in enumerate(pos.tolist()):
            for j in range(N_CTX):
                written = int(self.cell_pos[j]) >= 0
                if written and (int(self.cell_pos[j]) <= p if FIXED else j <= i):
                    mask[i, j] = 0.0
        return mask

    def decode(self, x, pos):
        self.cell_pos[pos] = pos
        mask = self.kq_mask(pos)
        hd = D // HEADS
        for il in range(LAYERS):
            self.k_buf[il][pos], self.v_buf[il][pos] = self.wk[il](x), self.wv[il](x)
            q = self.wq[il](x).view(-1, HEADS, hd).transpose(0, 1)
            k = self.k_buf[il].view(-1, HEADS, hd).transpose(0, 1)
            v = self.v_buf[il].view(-1, HEADS, hd).transpose(0, 1)
            weights = torch.softmax(q @ k.transpose(-1, -2) * hd ** -0.5 + mask, dim=-1)
            x = x + (weights @ v).transpose(0, 1).reshape(-1, D)
        return x


ctx = Context().eval()
with torch.no_grad():
    out = ctx.decode(torch.randn(5, D), torch.arange(5))
    for step in range(5, 8):
        out = ctx.decode(out[-1:], torch.tensor([step]))
print("last:", out[-1, :3].tolist())
