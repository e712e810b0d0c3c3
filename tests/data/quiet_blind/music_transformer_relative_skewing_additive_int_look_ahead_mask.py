"""Music Transformer relative global attention (skewing trick) with an additive look-ahead mask, True = hidden.

Follows jason9693/MusicTransformer-pytorch custom/layers.py (RelativeGlobalAttention: _get_left_embedding,
_qe_masking, _skewing, ``logits += (mask.to(torch.int64) * -1e9).to(logits.dtype)``; sequence_mask) and
utils.py (get_masked_with_pad_tensor: ``dec_trg_mask = trg == pad``; ``seq_mask = ~sequence_mask(arange(1,
size+1), size)``; ``look_ahead_mask = dec_trg_mask | seq_mask``), decoder-only generation as in model.py.
Mask meant: True marks what is hidden -- future positions and pad keys; each real event token attends to itself
and earlier real tokens, with a learned bias per relative distance (i - j).
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


def sequence_mask(length, max_length=None):
    """True for the first `length` positions of each row."""
    if max_length is None:
        max_length = length.max()
    x = torch.arange(max_length, dtype=length.dtype, device=length.device)
    return x.unsqueeze(0) < length.unsqueeze(1)


def get_look_ahead_mask(size, trg, pad_token):
    trg = trg[:, None, None, :]
    dec_trg_mask = trg == pad_token
    # boolean reversing: True where the key is in the future of the query
    seq_mask = ~sequence_mask(torch.arange(1, size + 1, device=trg.device), size)
    return dec_trg_mask | seq_mask


class RelativeGlobalAttention(nn.Module):
    def __init__(self, h=4, d=32, max_seq=16):
        super().__init__()
        self.h, self.d, self.dh, self.max_seq = h, d, d // h, max_seq
        self.Wq, self.Wk, self.Wv = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.fc = nn.Linear(d, d)
        self.E = nn.Parameter(torch.randn(self.max_seq, int(self.dh)))

    def forward(self, inputs, mask=None):
        q = self.Wq(inputs[0]).reshape(inputs[0].size(0), inputs[0].size(1), self.h, -1).permute(0, 2, 1, 3)
        k = self.Wk(inputs[1]).reshape(inputs[1].size(0), inputs[1].size(1), self.h, -1).permute(0, 2, 1, 3)
        v = self.Wv(inputs[2]).reshape(inputs[2].size(0), inputs[2].size(1), self.h, -1).permute(0, 2, 1, 3)
        self.len_k, self.len_q = k.size(2), q.size(2)
        E = self._get_left_embedding(self.len_q)
        QE = torch.einsum("bhld,md->bhlm", [q, E])
        QE = self._qe_masking(QE)
        Srel = self._skewing(QE)
        logits = (torch.matmul(q, k.permute(0, 1, 3, 2)) + Srel) / math.sqrt(self.dh)
        if mask is not None:
            logits += (mask.to(torch.int64) * -1e9).to(logits.dtype)
        attention_weights = F.softmax(logits, -1)
        attention = torch.matmul(attention_weights, v).permute(0, 2, 1, 3)
        return self.fc(attention.reshape(attention.size(0), -1, self.d))

    def _get_left_embedding(self, len_q):
        starting_point = max(0, self.max_seq - len_q)
        return self.E[starting_point:, :]

    @staticmethod
    def _qe_masking(qe):
        # zero the entries of QE that would wrap into the future after skewing
        mask = sequence_mask(torch.arange(qe.size(-1) - 1, qe.size(-1) - qe.size(-2) - 1, -1, device=qe.device), qe.size(-1))
        mask = ~mask
        return mask.to(qe.dtype) * qe

    def _skewing(self, tensor):
        padded = F.pad(tensor, [1, 0, 0, 0, 0, 0, 0, 0])
        reshaped = torch.reshape(padded, shape=[padded.size(0), padded.size(1), padded.size(-1), padded.size(-2)])
        Srel = reshaped[:, :, 1:, :]
        if self.len_k > self.len_q:
            Srel = F.pad(Srel, [0, 0, 0, 0, 0, 0, 0, self.len_k - self.len_q])
        elif self.len_k < self.len_q:
            Srel = Srel[:, :, :, :self.len_k]
        return Srel


class EncoderLayer(nn.Module):
    def __init__(self, d=32, h=4, max_seq=16):
        super().__init__()
        self.rga = RelativeGlobalAttention(h, d, max_seq)
        self.FFN = nn.Sequential(nn.Linear(d, d // 2), nn.ReLU(), nn.Linear(d // 2, d))
        self.layernorm1, self.layernorm2 = nn.LayerNorm(d, eps=1e-6), nn.LayerNorm(d, eps=1e-6)

    def forward(self, x, mask=None):
        out1 = self.layernorm1(self.rga([x, x, x], mask=mask) + x)
        return self.layernorm2(out1 + self.FFN(out1))


class MusicTransformer(nn.Module):
    def __init__(self, vocab_size=24, d=32, max_seq=16, pad_token=0):
        super().__init__()
        self.pad_token = pad_token
        self.embedding = nn.Embedding(vocab_size, d)
        self.enc_layers = nn.ModuleList([EncoderLayer(d, 4, max_seq) for _ in range(2)])
        self.fc = nn.Linear(d, vocab_size)

    def forward(self, x):
        look_ahead_mask = get_look_ahead_mask(x.size(1), x, self.pad_token)
        h = self.embedding(x) * math.sqrt(self.embedding.embedding_dim)
        for layer in self.enc_layers:
            h = layer(h, mask=look_ahead_mask)
        return self.fc(h)


def reference_rga(rga, x):
    """Double loop over absolute positions: key j <= i only, bias q_i . E[max_seq - 1 - (i - j)]."""
    B, L, _ = x.shape
    q = rga.Wq(x).view(B, L, rga.h, -1)
    k = rga.Wk(x).view(B, L, rga.h, -1)
    v = rga.Wv(x).view(B, L, rga.h, -1)
    out = torch.zeros(B, L, rga.h, rga.dh)
    for i in range(L):
        s = torch.stack([(q[:, i] * (k[:, j] + rga.E[rga.max_seq - 1 - (i - j)])).sum(-1) for j in range(i + 1)], -1)
        p = torch.softmax(s / math.sqrt(rga.dh), -1)
        out[:, i] = torch.einsum("bhj,bjhd->bhd", p, v[:, :i + 1])
    return rga.fc(out.reshape(B, L, -1))


def main():
    torch.manual_seed(0)
    model = MusicTransformer().eval()
    events = torch.randint(1, 24, (2, 10))
    events[1, 6:] = model.pad_token  # right-padded second performance
    with torch.no_grad():
        x = torch.randn(1, 7, 32)
        rga = model.enc_layers[0].rga
        assert torch.allclose(rga([x, x, x], mask=get_look_ahead_mask(7, torch.ones(1, 7, dtype=torch.long), 0)),
                              reference_rga(rga, x), atol=1e-4)
        logits = model(events)
        assert torch.allclose(logits[1, :6], model(events[1:, :6])[0], atol=1e-4)
    print("music transformer rga ok", tuple(logits.shape))


if __name__ == "__main__":
    main()
