# The fold slip of NeMo FastPitch (NVIDIA/NeMo#5450) written another way: a fairseq-style time-major layer, (T, B, C)
# hidden states, a left-padded batch of three with a model call's attention_mask, q/k/v projected to (T, B, H, D) and
# copied batch-major into B * H rows (permute(1, 2, 0, 3).reshape), while the key padding is tiled head-major with
# `.repeat(heads, ...)`, so with B > 1 each head of a sample takes another sample's padding. The fix tiles the padding
# the way the rows were laid: repeat_interleave(heads, 0).
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class SelfAttention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.in_proj = nn.Linear(dim, 3 * dim)
        self.out_proj = nn.Linear(dim, dim)

    def forward(self, x, key_pad):
        T, B, C = x.shape
        H, D = self.heads, self.head_dim
        q4, k4, v4 = self.in_proj(x).view(T, B, 3, H, D).unbind(2)  # each (T, B, H, D)
        q = q4.permute(1, 2, 0, 3).reshape(B * H, T, D)  # row b * H + h
        k = k4.permute(1, 2, 0, 3).reshape(B * H, T, D)
        v = v4.permute(1, 2, 0, 3).reshape(B * H, T, D)
        if FIXED:
            hidden = key_pad.repeat_interleave(H, 0)[:, None, :].expand(B * H, T, T)
        else:
            hidden = key_pad[:, None, :].repeat(H, T, 1)  # row h * B + b
        scores = torch.matmul(q, k.transpose(1, 2)) / D ** 0.5
        probs = scores.masked_fill(hidden, float("-inf")).softmax(-1)
        out = torch.matmul(probs, v).view(B, H, T, D).permute(2, 0, 1, 3).reshape(T, B, C)
        return self.out_proj(out)


class Model(nn.Module):
    def __init__(self, vocab=30, dim=16, heads=2, layers=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(SelfAttention(dim, heads) for _ in range(layers))

    def forward(self, input_ids, attention_mask):
        x = self.embed(input_ids).transpose(0, 1)  # time-major
        key_pad = attention_mask == 0
        for layer in self.layers:
            x = x + layer(x, key_pad)
        return x.transpose(0, 1)


input_ids = torch.tensor([[4, 8, 15, 16, 23, 9], [0, 0, 0, 7, 5, 3], [0, 12, 2, 6, 11, 14]])
attention_mask = (input_ids != 0).long()
model = Model().eval()
with torch.no_grad():
    batched = model(input_ids, attention_mask)
    alone = model(input_ids[1:2, 3:], attention_mask[1:2, 3:])
print(f"row 1: max |batched - alone| = {(batched[1, 3:] - alone[0]).abs().max().item():.6f}")
