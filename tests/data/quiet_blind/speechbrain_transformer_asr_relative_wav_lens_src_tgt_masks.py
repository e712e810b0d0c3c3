"""SpeechBrain TransformerASR: relative wav_lens to a source padding mask, carried into the decoder.

Follows speechbrain/speechbrain:
  speechbrain/lobes/models/transformer/TransformerASR.py
      make_transformer_src_tgt_masks(src, tgt, wav_len, causal, pad_idx):
          src_key_padding_mask = ~length_to_mask(torch.round(wav_len * src.shape[1]))  (True = pad)
          tgt_key_padding_mask = get_key_padding_mask(tgt, pad_idx), tgt_mask = get_lookahead_mask(tgt)
      TransformerASR.forward (teacher forcing) and TransformerASR.decode(tgt, encoder_out, enc_len):
          the memory_key_padding_mask is rebuilt from enc_len at every decoding step
  speechbrain/lobes/models/transformer/Transformer.py  get_lookahead_mask (float: 0 / -inf), get_key_padding_mask
  speechbrain/dataio/dataio.py  length_to_mask; wav_lens are lengths RELATIVE to the longest item in the batch
  speechbrain/decoders/seq2seq.py  S2STransformerGreedySearch (bos, argmax, fixed number of steps here)
Reduced: 3 utterances of 20, 15 and 10 feature frames (wav_lens 1.0, 0.75, 0.5), d_model 32, 2+2 layers
(nn.MultiheadAttention), custom_src_module = Linear, pad_idx 0, bos 1; float64.
Reference: each utterance alone (wav_lens = 1.0, no padding), targets alone, no masks other than look-ahead.
"""
import math
import torch
import torch.nn as nn

torch.manual_seed(0)
torch.set_default_dtype(torch.float64)
FEATS, D, HEADS, V, PAD, BOS = 10, 32, 4, 12, 0, 1


def length_to_mask(length, max_len):
    return torch.arange(max_len).unsqueeze(0) < length.unsqueeze(1)


def get_lookahead_mask(padded_input):
    ln = padded_input.shape[1]
    mask = (torch.triu(torch.ones((ln, ln))) == 1).transpose(0, 1)
    return mask.float().masked_fill(mask == 0, float("-inf")).masked_fill(mask == 1, float(0.0))


def get_key_padding_mask(padded_input, pad_idx):
    return padded_input.eq(pad_idx)


def pos_enc(x):
    n = x.shape[1]
    pos = torch.arange(n).unsqueeze(1)
    div = torch.exp(torch.arange(0, D, 2) * -(math.log(10000.0) / D))
    pe = torch.zeros(n, D)
    pe[:, 0::2], pe[:, 1::2] = torch.sin(pos * div), torch.cos(pos * div)
    return pe.unsqueeze(0)


class EncLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.att = nn.MultiheadAttention(D, HEADS, batch_first=True)
        self.ffn = nn.Sequential(nn.Linear(D, 64), nn.ReLU(), nn.Linear(64, D))
        self.n1, self.n2 = nn.LayerNorm(D), nn.LayerNorm(D)

    def forward(self, x, src_key_padding_mask):
        h = self.n1(x)
        x = x + self.att(h, h, h, key_padding_mask=src_key_padding_mask, need_weights=False)[0]
        return x + self.ffn(self.n2(x))


class DecLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.self_att = nn.MultiheadAttention(D, HEADS, batch_first=True)
        self.mutihead_attn = nn.MultiheadAttention(D, HEADS, batch_first=True)
        self.ffn = nn.Sequential(nn.Linear(D, 64), nn.ReLU(), nn.Linear(64, D))
        self.n1, self.n2, self.n3 = nn.LayerNorm(D), nn.LayerNorm(D), nn.LayerNorm(D)

    def forward(self, tgt, memory, tgt_mask, tgt_key_padding_mask, memory_key_padding_mask):
        h = self.n1(tgt)
        tgt = tgt + self.self_att(h, h, h, attn_mask=tgt_mask, key_padding_mask=tgt_key_padding_mask,
                                  need_weights=False)[0]
        h = self.n2(tgt)
        tgt = tgt + self.mutihead_attn(h, memory, memory, key_padding_mask=memory_key_padding_mask,
                                       need_weights=False)[0]
        return tgt + self.ffn(self.n3(tgt))


class TransformerASR(nn.Module):
    def __init__(self):
        super().__init__()
        self.custom_src_module = nn.Linear(FEATS, D)
        self.custom_tgt_module = nn.Embedding(V, D)
        self.enc = nn.ModuleList([EncLayer() for _ in range(2)])
        self.dec = nn.ModuleList([DecLayer() for _ in range(2)])
        self.enc_norm, self.dec_norm, self.out = nn.LayerNorm(D), nn.LayerNorm(D), nn.Linear(D, V)

    def encode(self, src, wav_len):
        abs_len = torch.round(wav_len * src.shape[1])
        src_key_padding_mask = ~length_to_mask(abs_len, src.shape[1])
        x = self.custom_src_module(src)
        x = x + pos_enc(x)
        for layer in self.enc:
            x = layer(x, src_key_padding_mask)
        return self.enc_norm(x)

    def decode(self, tgt, encoder_out, enc_len):
        tgt_mask = get_lookahead_mask(tgt)
        src_key_padding_mask = ~length_to_mask(enc_len, encoder_out.shape[1])
        tgt_key_padding_mask = get_key_padding_mask(tgt, PAD)
        t = self.custom_tgt_module(tgt)
        t = t + pos_enc(t)
        for layer in self.dec:
            t = layer(t, encoder_out, tgt_mask, tgt_key_padding_mask, src_key_padding_mask)
        return self.out(self.dec_norm(t)).log_softmax(-1)


def greedy(model, src, wav_lens, steps=5):
    enc = model.encode(src, wav_lens)
    enc_len = torch.round(enc.shape[1] * wav_lens)
    tokens = torch.full((src.shape[0], 1), BOS)
    for _ in range(steps):
        lp = model.decode(tokens, enc, enc_len)[:, -1].clone()
        lp[:, [PAD, BOS]] = float("-inf")   # never emit pad or bos: a generated pad would be masked as a key
        tokens = torch.cat([tokens, lp.argmax(-1, keepdim=True)], 1)
    return tokens


lens = [20, 15, 10]
feats = [torch.randn(n, FEATS) for n in lens]
src = torch.zeros(3, max(lens), FEATS)
for i, f in enumerate(feats):
    src[i, : len(f)] = f
wav_lens = torch.tensor(lens, dtype=torch.float64) / max(lens)       # relative lengths
targets = [torch.randint(3, V, (n,)) for n in (6, 4, 2)]
tgt = torch.full((3, 7), PAD)                                        # bos + tokens, right-padded with pad_idx
for i, t in enumerate(targets):
    tgt[i, 0], tgt[i, 1 : 1 + len(t)] = BOS, t

model = TransformerASR().eval()
with torch.no_grad():
    enc = model.encode(src, wav_lens)
    lp = model.decode(tgt, enc, torch.round(enc.shape[1] * wav_lens))
    hyp = greedy(model, src, wav_lens)
    max_diff = 0.0
    for i, (f, t) in enumerate(zip(feats, targets)):
        one = torch.ones(1)
        e1 = model.encode(f.unsqueeze(0), one)
        t1 = torch.cat([torch.tensor([BOS]), t]).unsqueeze(0)
        lp1 = model.decode(t1, e1, torch.round(e1.shape[1] * one))
        max_diff = max(max_diff, (enc[i, : len(f)] - e1[0]).abs().max().item(),
                       (lp[i, : t1.shape[1]] - lp1[0]).abs().max().item())
        assert greedy(model, f.unsqueeze(0), one)[0].tolist() == hyp[i].tolist()

print("greedy hyps", hyp[:, 1:].tolist())
print("max |padded batch - alone| (encoder, teacher-forced log-probs):", max_diff)
assert max_diff < 1e-10
