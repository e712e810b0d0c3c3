"""SAKT (Pandey & Karypis 2019) as pykt-toolkit writes it: pykt/models/sakt.py (SAKT.base_emb,
SAKT.forward, Blocks.forward, ut_mask) with the inputs pykt's training loop builds
(pykt/models/train_model.py: c, r = cseqs[:, :-1], rseqs[:, :-1]; cshft = shft_cseqs; sm masks the loss).

Intent kept as the project keeps it:
  * position t of the model carries interaction x_t = c_t + num_c * r_t (keys/values) and the
    NEXT exercise c_{t+1} (query, "qry" = shft_cseqs); it predicts r_{t+1};
  * ut_mask = torch.triu(ones, diagonal=1): the query at t sees interactions 0..t, its own
    position included. That diagonal is not a leak: interaction t is strictly before the
    exercise c_{t+1} being predicted;
  * pykt pads on the right, with padded ids multiplied to 0, and masks only the loss (sm).

Checks: the prediction of r_{t+1} never changes when r_{t+1} (or any later response) flips,
and each row of the padded batch equals the learner alone, unpadded, and a per-query loop
over its visible interactions for the first block's attention.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)
torch.set_default_dtype(torch.float64)
NUM_C, D, H, SEQ = 10, 32, 4, 16


def ut_mask(seq_len):
    return torch.triu(torch.ones(seq_len, seq_len), diagonal=1).to(dtype=torch.bool)


class Blocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(D, H, dropout=0.0)
        self.attn_layer_norm, self.FFN_layer_norm = nn.LayerNorm(D), nn.LayerNorm(D)
        self.FFN = nn.Sequential(nn.Linear(D, D), nn.ReLU(), nn.Linear(D, D))

    def forward(self, q, k, v):
        q, k, v = q.permute(1, 0, 2), k.permute(1, 0, 2), v.permute(1, 0, 2)
        causal_mask = ut_mask(seq_len=k.shape[0])
        attn_emb, _ = self.attn(q, k, v, attn_mask=causal_mask)
        attn_emb, q = attn_emb.permute(1, 0, 2), q.permute(1, 0, 2)
        attn_emb = self.attn_layer_norm(q + attn_emb)
        return self.FFN_layer_norm(attn_emb + self.FFN(attn_emb))


class SAKT(nn.Module):
    def __init__(self, num_en=2):
        super().__init__()
        self.interaction_emb = nn.Embedding(NUM_C * 2, D)
        self.exercise_emb = nn.Embedding(NUM_C, D)
        self.position_emb = nn.Embedding(SEQ, D)
        self.blocks = nn.ModuleList([Blocks() for _ in range(num_en)])
        self.pred = nn.Linear(D, 1)

    def base_emb(self, q, r, qry):
        x = q + NUM_C * r
        qshftemb, xemb = self.exercise_emb(qry), self.interaction_emb(x)
        posemb = self.position_emb(torch.arange(xemb.shape[1]).unsqueeze(0))
        return qshftemb, xemb + posemb

    def forward(self, q, r, qry):
        qemb, xemb = self.base_emb(q, r, qry)
        for blk in self.blocks:
            xemb = blk(qemb, xemb, xemb)
        return torch.sigmoid(self.pred(xemb)).squeeze(-1)


model = SAKT().eval()
lens = [14, 9, 5]  # interactions per learner
L = max(lens)
cseqs = torch.zeros(3, L, dtype=torch.long)
rseqs = torch.zeros(3, L, dtype=torch.long)
mask_seqs = torch.zeros(3, L, dtype=torch.long)
for b, n in enumerate(lens):
    cseqs[b, :n], rseqs[b, :n], mask_seqs[b, :n] = torch.randint(0, NUM_C, (n,)), torch.randint(0, 2, (n,)), 1
cseqs, rseqs = cseqs * mask_seqs, rseqs * mask_seqs   # pykt's padded ids are multiplied to 0


def run(c_all, r_all):
    c, r, cshft = c_all[:, :-1], r_all[:, :-1], c_all[:, 1:]
    return model(c, r, cshft)


with torch.no_grad():
    y = run(cseqs, rseqs)                       # y[:, t] predicts r_{t+1}
    sm = mask_seqs[:, 1:].bool()
    loss = F.binary_cross_entropy(torch.masked_select(y, sm), torch.masked_select(rseqs[:, 1:].double(), sm))
    d1 = 0.0
    for t in range(1, L):                      # flip r_t and later: predictions of r_1..r_t unchanged
        r2 = rseqs.clone()
        r2[:, t:] = 1 - r2[:, t:]
        d1 = max(d1, (run(cseqs, r2)[:, :t] - y[:, :t]).abs().max().item())
    d2 = max((run(cseqs[b:b + 1, :n], rseqs[b:b + 1, :n])[0] - y[b, :n - 1]).abs().max().item()
             for b, n in enumerate(lens))
    # first block's attention by an explicit per-query loop over interactions 0..t
    blk = model.blocks[0]
    qemb, xemb = model.base_emb(cseqs[:, :-1], rseqs[:, :-1], cseqs[:, 1:])
    ref = blk(qemb, xemb, xemb)
    W, B = blk.attn.in_proj_weight, blk.attn.in_proj_bias
    d3 = 0.0
    for b in range(3):
        Q = (qemb[b] @ W[:D].T + B[:D]).view(-1, H, D // H)
        K = (xemb[b] @ W[D:2 * D].T + B[D:2 * D]).view(-1, H, D // H)
        V = (xemb[b] @ W[2 * D:].T + B[2 * D:]).view(-1, H, D // H)
        for t in range(L - 1):
            w = torch.softmax(torch.einsum('hd,khd->hk', Q[t], K[:t + 1]) / (D // H) ** 0.5, -1)
            o = blk.attn.out_proj(torch.einsum('hk,khd->hd', w, V[:t + 1]).reshape(D))
            o = blk.attn_layer_norm(qemb[b, t] + o)
            o = blk.FFN_layer_norm(o + blk.FFN(o))
            d3 = max(d3, (o - ref[b, t]).abs().max().item())

print(f"predictions of r_1..r_t when r_t.. flip: max change = {d1:.3e}")
print(f"padded batch vs each learner alone: max diff = {d2:.3e}")
print(f"block 0 vs per-query loop over interactions 0..t: max diff = {d3:.3e}; loss = {loss.item():.4f}")
assert d1 < 1e-12 and d2 < 1e-12 and d3 < 1e-12
