"""TiSASRec: time-interval aware self-attention over left-padded user histories.

Follows pmixer/TiSASRec.pytorch:
  utils.py  sample_function: seq / time_seq filled from the END (index maxlen-1 backwards), 0 = padding item
            computeRePos: relation matrix |t_i - t_j| clipped to time_span
  model.py  TiSASRec.seq2feats: timeline_mask = (log_seqs == 0), seqs *= ~timeline_mask,
            attention_mask = ~tril(ones(tl, tl)) (True = hidden), abs position + time-interval key/value embeddings
            TimeAwareMultiHeadAttention.forward: hand-written softmax, paddings = -2**32+1 on masked scores,
            then paddings on timeline_mask keys, outputs of padded queries zeroed (*= ~timeline_mask)
            TiSASRec.predict: score items with the LAST position's features (log_feats[:, -1, :])
Reduced: 3 users with 7, 4 and 2 interactions, maxlen 8, 2 blocks, hidden 16, 2 heads.
Changed from the original: upstream fills paddings on padded QUERY rows (time_mask) and the causal mask only;
here the timeline mask is applied to the KEYS as well, so a left pad (whose value still carries position and
bias terms) is never attended by a real item. A padded query row is then all-masked and its output zeroed.
Reference: each user's history alone, unpadded, with the causal mask only; absolute positions are indices
into the padded window in upstream, so the reference uses the same last-aligned positions.
"""
import torch
import torch.nn as nn

torch.manual_seed(0)
torch.set_default_dtype(torch.float64)

N_ITEMS, MAXLEN, D, HEADS, SPAN = 20, 8, 16, 2, 6
NEG = -2.0 ** 32 + 1


def compute_repos(time_seq, span):
    diff = (time_seq.unsqueeze(-1) - time_seq.unsqueeze(-2)).abs()
    return diff.clamp(max=span)


class TimeAwareMHA(nn.Module):
    def __init__(self):
        super().__init__()
        self.Q, self.K, self.V = nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, queries, keys, time_mask, attn_mask, tk, tv, ak, av):
        b, t, _ = queries.shape
        h, dh = HEADS, D // HEADS
        split = lambda x: x.view(*x.shape[:-1], h, dh)
        q, k, v = split(self.Q(queries)), split(self.K(keys)), split(self.V(keys))
        ak_, av_ = split(ak), split(av)          # (b, t, h, dh)  absolute position keys/values
        tk_, tv_ = split(tk), split(tv)          # (b, t, t, h, dh) interval keys/values
        w = torch.einsum("bqhd,bkhd->bhqk", q, k + ak_)
        w = w + torch.einsum("bqhd,bqkhd->bhqk", q, tk_)
        w = w / dh ** 0.5
        hidden = attn_mask.unsqueeze(0) | time_mask[:, None, None, :]   # (b,1,t,t) True = hidden
        w = torch.where(hidden, torch.full_like(w, NEG), w)
        p = torch.softmax(w, dim=-1)
        out = torch.einsum("bhqk,bkhd->bqhd", p, v + av_) + torch.einsum("bhqk,bqkhd->bqhd", p, tv_)
        return out.reshape(b, t, D)


class TiSASRec(nn.Module):
    def __init__(self):
        super().__init__()
        self.item_emb = nn.Embedding(N_ITEMS + 1, D, padding_idx=0)
        self.abs_pos_K, self.abs_pos_V = nn.Embedding(MAXLEN, D), nn.Embedding(MAXLEN, D)
        self.time_K, self.time_V = nn.Embedding(SPAN + 1, D), nn.Embedding(SPAN + 1, D)
        self.attn = nn.ModuleList([TimeAwareMHA() for _ in range(2)])
        self.ln = nn.ModuleList([nn.LayerNorm(D) for _ in range(4)])
        self.ff = nn.ModuleList([nn.Sequential(nn.Linear(D, D), nn.ReLU(), nn.Linear(D, D)) for _ in range(2)])
        self.last = nn.LayerNorm(D)

    def seq2feats(self, log_seqs, time_matrices, positions):
        seqs = self.item_emb(log_seqs) * D ** 0.5
        timeline_mask = log_seqs == 0
        seqs = seqs * ~timeline_mask.unsqueeze(-1)
        tl = seqs.shape[1]
        attention_mask = ~torch.tril(torch.ones(tl, tl, dtype=torch.bool))
        ak, av = self.abs_pos_K(positions), self.abs_pos_V(positions)
        tk, tv = self.time_K(time_matrices), self.time_V(time_matrices)
        for i in range(2):
            q = self.ln[2 * i](seqs)
            seqs = q + self.attn[i](q, seqs, timeline_mask, attention_mask, tk, tv, ak, av)
            seqs = self.ln[2 * i + 1](seqs)
            seqs = seqs + self.ff[i](seqs)
            seqs = seqs * ~timeline_mask.unsqueeze(-1)
        return self.last(seqs)

    def predict(self, log_seqs, time_matrices, positions, item_indices):
        final = self.seq2feats(log_seqs, time_matrices, positions)[:, -1, :]
        return torch.einsum("bd,bnd->bn", final, self.item_emb(item_indices))


histories = []
for n in (7, 4, 2):
    items = torch.randint(1, N_ITEMS + 1, (n,))
    times = torch.cumsum(torch.randint(0, 4, (n,)), 0) + 1
    histories.append((items, times))

seq = torch.zeros(3, MAXLEN, dtype=torch.long)
tseq = torch.zeros(3, MAXLEN, dtype=torch.long)
for u, (items, times) in enumerate(histories):       # sample_function: fill from the end
    seq[u, MAXLEN - len(items):] = items
    tseq[u, MAXLEN - len(items):] = times
time_mat = compute_repos(tseq, SPAN)
positions = torch.arange(MAXLEN).expand(3, MAXLEN)
cands = torch.randint(1, N_ITEMS + 1, (3, 5))

model = TiSASRec().eval()
with torch.no_grad():
    feats = model.seq2feats(seq, time_mat, positions)
    scores = model.predict(seq, time_mat, positions, cands)
    max_diff = 0.0
    for u, (items, times) in enumerate(histories):
        n = len(items)
        pos = torch.arange(MAXLEN - n, MAXLEN).unsqueeze(0)
        f1 = model.seq2feats(items.unsqueeze(0), compute_repos(times.unsqueeze(0), SPAN), pos)
        s1 = model.predict(items.unsqueeze(0), compute_repos(times.unsqueeze(0), SPAN), pos, cands[u : u + 1])
        max_diff = max(max_diff, (feats[u, MAXLEN - n:] - f1[0]).abs().max().item(),
                       (scores[u] - s1[0]).abs().max().item())
        assert feats[u, : MAXLEN - n].abs().max().item() == 0.0

print("scores", scores.argmax(-1).tolist())
print("max |left-padded batch - alone|:", max_diff)
assert max_diff < 1e-10
