# Follows pmixer/SASRec.pytorch python/model.py, SASRec.log2feats: item histories are LEFT-padded with id 0,
# timeline_mask = (log_seqs == 0) zeroes pad rows, attention_mask = ~tril (True = blocked, nn.MultiheadAttention
# convention). Pad keys are also blocked; pad queries then see nothing and are zeroed afterwards by timeline_mask.
import torch
torch.manual_seed(0); torch.set_default_dtype(torch.float64)
L, D, H, NITEMS = 10, 32, 2, 40
item_emb = torch.nn.Embedding(NITEMS + 1, D, padding_idx=0)
pos_emb = torch.nn.Embedding(L + 1, D, padding_idx=0)
ln_q, ln_f, ln_ff = torch.nn.LayerNorm(D), torch.nn.LayerNorm(D), torch.nn.LayerNorm(D)
attn = torch.nn.MultiheadAttention(D, H, batch_first=True)
ffn = torch.nn.Sequential(torch.nn.Linear(D, D), torch.nn.ReLU(), torch.nn.Linear(D, D))

def log2feats(log_seqs, poss):
    seqs = item_emb(log_seqs) * D ** 0.5 + pos_emb(poss)
    timeline_mask = log_seqs == 0
    seqs = seqs * ~timeline_mask.unsqueeze(-1)
    tl = seqs.shape[1]
    attention_mask = ~torch.tril(torch.ones((tl, tl), dtype=torch.bool))        # True = blocked
    blocked = attention_mask[None] | timeline_mask[:, None, :]                   # also block pad keys
    bias = torch.zeros(blocked.shape).masked_fill(blocked, torch.finfo(torch.float64).min)
    bias = bias.repeat_interleave(H, dim=0)                                      # (B*H, T, T) float bias
    Q = ln_q(seqs)
    out, _ = attn(Q, seqs, seqs, attn_mask=bias, need_weights=False)
    seqs = Q + out
    seqs = seqs + ffn(ln_ff(seqs))
    seqs = seqs * ~timeline_mask.unsqueeze(-1)                                   # pad rows discarded
    return ln_f(seqs)

lens = [10, 6, 3, 1]
hist = [torch.randint(1, NITEMS + 1, (n,)) for n in lens]
batch = torch.zeros(len(lens), L, dtype=torch.long)
for b, h in enumerate(hist):
    batch[b, L - len(h):] = h                                                    # left padding
poss = torch.arange(1, L + 1).expand(len(lens), L) * (batch != 0)                # SASRec: poss *= (log_seqs != 0)
with torch.no_grad():
    feats = log2feats(batch, poss)
    diff = 0.0
    for b, h in enumerate(hist):
        n = len(h)
        ref = log2feats(h[None], torch.arange(L - n + 1, L + 1)[None])           # same sequence alone, unpadded
        diff = max(diff, (feats[b, L - n:] - ref[0]).abs().max().item())
        assert torch.isfinite(feats[b]).all()
print("max diff padded-batch vs each history alone:", diff)
assert diff < 1e-10
