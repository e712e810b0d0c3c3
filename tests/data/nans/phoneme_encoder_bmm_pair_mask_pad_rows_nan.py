# Written another way (the bug of nari-labs/dia#252: the encoder's mask became `p_mask_q & p_mask_k`, so the padded
# text's query rows see no key and turn NaN under an -inf fill, and the NaN reaches the real tokens through the
# values): a phoneme encoder whose heads are folded into the batch (B * H, T, T) and scored with torch.bmm, its pair
# mask the product of the right-padded rows' real flags as floats, filled in place with -inf where it is 0. The fix,
# as dia's: pad queries attend pad keys (`real_q * real_k + (1 - real_q) * (1 - real_k)`), so no row is empty.
import sys

import torch
from torch import nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

PHONEMES, DIM, HEADS, PAD = 30, 24, 3, 0


class BmmSelfAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.to_qkv = nn.Linear(DIM, 3 * DIM, bias=False)
        self.out = nn.Linear(DIM, DIM)
        self.head_dim = DIM // HEADS

    def forward(self, x, pair):
        b, t, _ = x.shape
        q, k, v = (y.reshape(b, t, HEADS, self.head_dim).transpose(1, 2).reshape(b * HEADS, t, self.head_dim)
                   for y in self.to_qkv(x).chunk(3, dim=-1))
        scores = torch.bmm(q, k.transpose(1, 2)) / self.head_dim ** 0.5  # (B * H, T, T)
        scores.masked_fill_(pair.repeat_interleave(HEADS, dim=0) == 0, float("-inf"))
        weights = torch.softmax(scores, dim=-1)
        out = torch.bmm(weights, v).reshape(b, HEADS, t, self.head_dim).transpose(1, 2).reshape(b, t, DIM)
        return x + self.out(out)


class PhonemeEncoder(nn.Module):
    def __init__(self, layers=2):
        super().__init__()
        self.embed = nn.Embedding(PHONEMES, DIM)
        self.layers = nn.ModuleList([BmmSelfAttention() for _ in range(layers)])

    def forward(self, phonemes):
        real = (phonemes != PAD).float()  # (B, T): 1 = a real phoneme
        pair = real[:, :, None] * real[:, None, :]
        if FIXED:
            pair = pair + (1 - real[:, :, None]) * (1 - real[:, None, :])  # pad queries attend pad keys
        x = self.embed(phonemes)
        for layer in self.layers:
            x = layer(x, pair)
        return x


encoder = PhonemeEncoder().eval()
lengths = [6, 10, 3]
phonemes = torch.full((3, 10), PAD)
for row, n in enumerate(lengths):
    phonemes[row, :n] = torch.randint(1, PHONEMES, (n,))
with torch.no_grad():
    out = encoder(phonemes)
real_nan = sum(int(out[row, :n].isnan().sum()) for row, n in enumerate(lengths))
print(f"NaN entries in the real phonemes' encodings: {real_nan}")
