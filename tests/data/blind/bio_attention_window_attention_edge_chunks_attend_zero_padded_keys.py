# gdewael/bio-attention#2 (commits dac2efc + 6c10248, merge c129318): WindowAttention pads k/v with w zeros on the
# left and w + k_pad zeros on the right before unfolding into chunks, but used one band mask for every chunk, so
# queries near the sequence ends attended those zero-padded key slots (and q was unfolded from k).
# The fix adds mask_k_left / mask_k_right for the first and last chunk and unfolds q from q.
import math
import sys

import torch
import torch.nn.functional as F
from torch import einsum, nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


def compl_mod(m, n):
    return int(n * math.ceil(m / n) - m)


class WindowAttention(nn.Module):
    def __init__(self, window, dropout=0.1):
        super().__init__()
        assert window % 2 == 1, 'Window size should be an odd integer.'

        self.softmax = nn.Softmax(dim=-1)
        self.dropout = nn.Dropout(dropout)
        self.w = int((window - 1) / 2)

        self.k_ch = window * 2
        self.q_ch = window + 1

        u = torch.triu(torch.full((self.q_ch, self.k_ch), True))
        if FIXED:
            self.mask = ~torch.logical_and(u, torch.flip(u, [0, 1]))
            self.mask_k_left = torch.clone(self.mask)
            self.mask_k_left[:, :self.w] = True
        else:
            l = torch.tril(torch.full((self.q_ch, self.k_ch), True), self.w * 2)
            self.mask = torch.logical_and(u, l)

    def forward(self, q, k, v):
        assert k.shape[1] == q.shape[1], 'q and k should have same input length.'
        b, s, nh, h = k.shape

        q = q * (h ** -.5)

        q_pad = compl_mod(s, self.q_ch)
        k_pad = compl_mod((s + self.w * 2) - self.k_ch, self.q_ch)

        if FIXED:
            q = F.pad(q, (0,) * 5 + (q_pad,)).unfold(1, self.q_ch, self.q_ch)
        else:
            q = F.pad(k, (0,) * 5 + (q_pad,)).unfold(1, self.q_ch, self.q_ch)
        k = F.pad(k, (0,) * 4 + (self.w, self.w + k_pad)).unfold(1, self.k_ch, self.q_ch)
        v = F.pad(v, (0,) * 4 + (self.w, self.w + k_pad)).unfold(1, self.k_ch, self.q_ch)

        A = einsum('b c n h q, b c n h k -> b n c q k ', q, k)

        mask_value = -torch.finfo(A.dtype).max
        if FIXED:
            mask_k_right = torch.clone(self.mask.to(A.device))
            mask_k_right[:, -(self.w + k_pad):] = True
            if q.shape[1] > 1:
                mask = torch.stack([self.mask_k_left.to(A.device)] +
                                   [self.mask.to(A.device)] * (q.shape[1] - 2) +
                                   [mask_k_right])
            else:
                mask = torch.logical_or(self.mask_k_left.to(A.device),
                                        mask_k_right).unsqueeze(0)

            A[:].masked_fill_(mask, mask_value)
        else:
            A[:, :].masked_fill_(~self.mask.to(A.device), mask_value)
        A = self.softmax(A)
        A = self.dropout(A)

        z = einsum('b n c q k, b c n h k -> b n c q h', A, v)
        z = z.view(b, nh, -1, h)[:, :, :s].permute(0, 2, 1, 3)

        return z


class WindowTransformerLayer(nn.Module):
    def __init__(self, dim, nh, window, dropout=0.0):
        super().__init__()
        self.nh = nh
        self.norm = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.attn = WindowAttention(window, dropout=dropout)
        self.out = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.ff = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, s, 3, self.nh, d // self.nh).unbind(2)
        z = self.attn(q, k, v).reshape(b, s, d)
        x = x + self.out(z)
        return x + self.ff(self.norm2(x))


dim, nh, window, L = 64, 4, 9, 47
embed = nn.Embedding(4, dim)  # A, C, G, T
layers = nn.ModuleList([WindowTransformerLayer(dim, nh, window) for _ in range(2)])
head = nn.Linear(dim, 1)
params = list(embed.parameters()) + list(layers.parameters()) + list(head.parameters())
opt = torch.optim.AdamW(params, lr=1e-3)

seq = torch.randint(0, 4, (2, L))
y = torch.randn(2, L)

x = embed(seq)
for layer in layers:
    x = layer(x)
pred = head(x).squeeze(-1)
loss = F.mse_loss(pred, y)
opt.zero_grad()
loss.backward()
opt.step()
print(f"loss {loss.item():.5f}  out-norm {x.norm().item():.4f}")
