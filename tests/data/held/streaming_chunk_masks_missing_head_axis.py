# Written another way (bigcode-project/Megatron-LM commit 324d70d's bug, in a streaming speech encoder's style): each
# utterance's chunk_masks (B, T, T) (True = may attend: the frames of its own chunk and the chunks before, padding
# frames hidden) are laid on (B, heads, T, T) scores by masked_fill(~mask) without their head axis; with as many
# utterances as heads, head h of every utterance runs with utterance h's chunks and padding. The fix: unsqueeze(1).
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
D_MODEL, N_HEAD, CHUNK = 24, 3, 3
XS_LENS = torch.tensor([9, 5, 7])


def make_pad_mask(lengths, max_len):
    return torch.arange(max_len)[None, :] >= lengths[:, None]  # True = padding


def subsequent_chunk_mask(size, chunk_size):
    ret = torch.zeros(size, size, dtype=torch.bool)
    for i in range(size):
        ret[i, :min((i // chunk_size + 1) * chunk_size, size)] = True
    return ret


class MultiHeadedAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.d_k = D_MODEL // N_HEAD
        self.linear_q = nn.Linear(D_MODEL, D_MODEL)
        self.linear_k = nn.Linear(D_MODEL, D_MODEL)
        self.linear_v = nn.Linear(D_MODEL, D_MODEL)
        self.linear_out = nn.Linear(D_MODEL, D_MODEL)

    def forward(self, x, mask):
        n_batch = x.size(0)
        q = self.linear_q(x).view(n_batch, -1, N_HEAD, self.d_k).transpose(1, 2)
        k = self.linear_k(x).view(n_batch, -1, N_HEAD, self.d_k).transpose(1, 2)
        v = self.linear_v(x).view(n_batch, -1, N_HEAD, self.d_k).transpose(1, 2)
        scores = torch.matmul(q, k.transpose(-2, -1)) / self.d_k ** 0.5
        if FIXED:
            mask = mask.unsqueeze(1)  # (batch, 1, time1, time2)
        scores = scores.masked_fill(~mask, -float("inf"))
        attn = torch.softmax(scores, dim=-1).masked_fill(~mask, 0.0)
        x = torch.matmul(attn, v).transpose(1, 2).contiguous().view(n_batch, -1, D_MODEL)
        return self.linear_out(x)


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([MultiHeadedAttention() for _ in range(2)])

    def forward(self, xs, xs_lens):
        masks = ~make_pad_mask(xs_lens, xs.size(1))
        chunk_masks = subsequent_chunk_mask(xs.size(1), CHUNK)[None] & masks[:, None, :]  # (B, T, T)
        chunk_masks = chunk_masks | torch.eye(xs.size(1), dtype=torch.bool)[None]  # a padding frame sees itself
        for layer in self.layers:
            xs = xs + layer(xs, chunk_masks)
        return xs


encoder = Encoder().eval()
xs = torch.randn(3, int(XS_LENS.max()), D_MODEL)
with torch.no_grad():
    out = encoder(xs, XS_LENS)
    worst = max((out[i, :n] - encoder(xs[i:i + 1, :n], XS_LENS[i:i + 1])[0]).abs().max().item()
                for i, n in enumerate(XS_LENS.tolist()))
print(f"max |batched - one utterance| over real frames = {worst:.6f}")
