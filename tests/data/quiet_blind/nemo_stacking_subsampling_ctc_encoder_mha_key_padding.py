"""NeMo-style speech encoder over padded mel frames, frame-stacking subsampling, CTC greedy decode.

Follows NVIDIA/NeMo:
  nemo/collections/asr/modules/audio_preprocessing.py  AudioToMelSpectrogramPreprocessor (pad_value=0 after seq_len)
  nemo/collections/asr/parts/submodules/subsampling.py  StackingSubsampling.forward / get_output_length
  nemo/collections/asr/modules/transformer/transformer_encoders.py (self-attention encoder, padding mask from lengths)
  nemo/collections/asr/parts/submodules/ctc_decoding.py  greedy: argmax per frame, only the first `length` frames
Reduced: 3 utterances of 23, 17 and 9 feature frames, stacking factor 4, 2 layers of nn.MultiheadAttention.
The lengths are the program's statement of which frames are audio; after stacking, the encoded length is
ceil(len / 4) and key_padding_mask hides the stacked frames at and after it.
Reference: each utterance encoded alone, unpadded, with no mask.
"""
import math
import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)
torch.set_default_dtype(torch.float64)

N_MELS, D, HEADS, VOCAB, FACTOR = 8, 32, 4, 6, 4  # vocab includes blank = VOCAB-1


class StackingSubsampling(nn.Module):
    def __init__(self, factor, feat_in, feat_out):
        super().__init__()
        self.factor = factor
        self.proj_out = nn.Linear(factor * feat_in, feat_out)

    def get_output_length(self, lengths):
        return torch.div(lengths + self.factor - 1, self.factor, rounding_mode="floor")

    def forward(self, x, lengths):
        b, t, h = x.size()
        pad_size = (self.factor - (t % self.factor)) % self.factor
        x = F.pad(x, (0, 0, 0, pad_size))
        _, t, _ = x.size()
        x = torch.reshape(x, (b, t // self.factor, h * self.factor))
        x = self.proj_out(x)
        return x, self.get_output_length(lengths)


def sinusoid(n, d):
    pos = torch.arange(n).unsqueeze(1)
    div = torch.exp(torch.arange(0, d, 2) * (-math.log(10000.0) / d))
    pe = torch.zeros(n, d)
    pe[:, 0::2] = torch.sin(pos * div)
    pe[:, 1::2] = torch.cos(pos * div)
    return pe


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.attn = nn.MultiheadAttention(D, HEADS, batch_first=True)
        self.ff = nn.Sequential(nn.Linear(D, 4 * D), nn.SiLU(), nn.Linear(4 * D, D))

    def forward(self, x, pad_mask):
        h = self.norm1(x)
        a, _ = self.attn(h, h, h, key_padding_mask=pad_mask, need_weights=False)
        x = x + a
        return x + self.ff(self.norm2(x))


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.pre_encode = StackingSubsampling(FACTOR, N_MELS, D)
        self.layers = nn.ModuleList([Layer() for _ in range(2)])
        self.ctc = nn.Linear(D, VOCAB)

    def forward(self, audio_signal, length):
        x, length = self.pre_encode(audio_signal, length)
        x = x * math.sqrt(D) + sinusoid(x.size(1), D)
        pad_mask = None
        if audio_signal.size(0) > 1 or length.item() < x.size(1):
            # True = padded frame, as nn.MultiheadAttention expects
            pad_mask = torch.arange(x.size(1)).unsqueeze(0) >= length.unsqueeze(1)
        for layer in self.layers:
            x = layer(x, pad_mask)
        return self.ctc(x).log_softmax(-1), length


def ctc_greedy(log_probs, lengths, blank=VOCAB - 1):
    out = []
    for lp, n in zip(log_probs, lengths.tolist()):
        ids = lp[:n].argmax(-1).tolist()
        seq, prev = [], None
        for i in ids:
            if i != prev and i != blank:
                seq.append(i)
            prev = i
        out.append(seq)
    return out


model = Encoder().eval()
lens = torch.tensor([23, 17, 9])
feats = [torch.randn(n, N_MELS) for n in lens.tolist()]
batch = torch.zeros(len(feats), int(lens.max()), N_MELS)  # pad_value = 0.0 after seq_len
for i, f in enumerate(feats):
    batch[i, : f.size(0)] = f

with torch.no_grad():
    lp, enc_len = model(batch, lens)
    hyps = ctc_greedy(lp, enc_len)
    max_diff = 0.0
    for i, f in enumerate(feats):
        lp1, n1 = model(f.unsqueeze(0), lens[i : i + 1])
        assert n1.item() == enc_len[i].item() == math.ceil(lens[i].item() / FACTOR)
        max_diff = max(max_diff, (lp[i, : n1.item()] - lp1[0]).abs().max().item())
        assert ctc_greedy(lp1, n1)[0] == hyps[i]

print("encoded lengths", enc_len.tolist(), "hyps", hyps)
print("max |batched - alone| over real frames:", max_diff)
assert max_diff < 1e-10
