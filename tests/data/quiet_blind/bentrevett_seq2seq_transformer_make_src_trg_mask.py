"""bentrevett/pytorch-seq2seq tutorial 6 "Attention is All You Need": make_src_mask / make_trg_mask.

Follows bentrevett/pytorch-seq2seq, 6 - Attention is All You Need.ipynb (Seq2Seq.make_src_mask:
(src != src_pad_idx).unsqueeze(1).unsqueeze(2); Seq2Seq.make_trg_mask: trg_pad_mask & torch.tril(ones);
MultiHeadAttentionLayer.forward: energy.masked_fill(mask == 0, -1e10) then softmax). Commit: not pinned.
Plain torch, hand-written softmax. Reference: each pair translated alone without padding.
"""
import torch
import torch.nn as nn

torch.manual_seed(0)
HID, HEADS, SRC_V, TRG_V = 32, 4, 30, 30
SRC_PAD = TRG_PAD = 1


class MHA(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc_q, self.fc_k, self.fc_v, self.fc_o = (nn.Linear(HID, HID) for _ in range(4))
        self.hd = HID // HEADS

    def forward(self, query, key, value, mask=None):
        B = query.shape[0]
        Q = self.fc_q(query).view(B, -1, HEADS, self.hd).permute(0, 2, 1, 3)
        K = self.fc_k(key).view(B, -1, HEADS, self.hd).permute(0, 2, 1, 3)
        V = self.fc_v(value).view(B, -1, HEADS, self.hd).permute(0, 2, 1, 3)
        energy = Q @ K.permute(0, 1, 3, 2) / self.hd ** 0.5
        if mask is not None:
            energy = energy.masked_fill(mask == 0, -1e10)
        attention = torch.softmax(energy, dim=-1)
        x = (attention @ V).permute(0, 2, 1, 3).reshape(B, -1, HID)
        return self.fc_o(x)


class Seq2Seq(nn.Module):
    def __init__(self):
        super().__init__()
        self.src_emb, self.trg_emb = nn.Embedding(SRC_V, HID), nn.Embedding(TRG_V, HID)
        self.pos = nn.Embedding(20, HID)
        self.enc_attn, self.dec_self, self.dec_cross = MHA(), MHA(), MHA()
        self.ln = nn.ModuleList(nn.LayerNorm(HID) for _ in range(3))
        self.fc_out = nn.Linear(HID, TRG_V)

    def make_src_mask(self, src):
        return (src != SRC_PAD).unsqueeze(1).unsqueeze(2)  # (B,1,1,S)

    def make_trg_mask(self, trg):
        trg_pad_mask = (trg != TRG_PAD).unsqueeze(1).unsqueeze(2)  # (B,1,1,T)
        L = trg.shape[1]
        trg_sub_mask = torch.tril(torch.ones((L, L))).bool()
        return trg_pad_mask & trg_sub_mask  # (B,1,T,T)

    def forward(self, src, trg):
        src_mask, trg_mask = self.make_src_mask(src), self.make_trg_mask(trg)
        s = self.src_emb(src) * HID ** 0.5 + self.pos(torch.arange(src.shape[1]))
        enc = self.ln[0](s + self.enc_attn(s, s, s, src_mask))
        t = self.trg_emb(trg) * HID ** 0.5 + self.pos(torch.arange(trg.shape[1]))
        t = self.ln[1](t + self.dec_self(t, t, t, trg_mask))
        t = self.ln[2](t + self.dec_cross(t, enc, enc, src_mask))
        return self.fc_out(t)


model = Seq2Seq().eval().double()
pairs = [([2, 5, 6, 7, 3], [2, 9, 10, 3]), ([2, 8, 3], [2, 11, 12, 13, 14, 3]), ([2, 4, 4, 5, 6, 7, 3], [2, 15, 3])]


def pad(seqs, p):
    L = max(map(len, seqs))
    return torch.tensor([s + [p] * (L - len(s)) for s in seqs])


src, trg = pad([p[0] for p in pairs], SRC_PAD), pad([p[1] for p in pairs], TRG_PAD)
with torch.no_grad():
    # teacher forcing as in train(): decoder input trg[:, :-1], targets trg[:, 1:]
    out = model(src, trg[:, :-1])
    loss = nn.functional.cross_entropy(out.reshape(-1, TRG_V), trg[:, 1:].reshape(-1), ignore_index=TRG_PAD)
    worst, ref_loss, n = 0.0, 0.0, 0
    for i, (s, t) in enumerate(pairs):
        o = model(torch.tensor([s]), torch.tensor([t[:-1]]))
        worst = max(worst, (out[i, : len(t) - 1] - o[0]).abs().max().item())
        ref_loss += nn.functional.cross_entropy(o[0], torch.tensor(t[1:]), reduction="sum").item()
        n += len(t) - 1
print("max |padded batch logits - one pair at a time| =", worst)
print("loss batch %.12f  loss reference %.12f" % (loss.item(), ref_loss / n))
assert worst < 1e-9 and abs(loss.item() - ref_loss / n) < 1e-9
