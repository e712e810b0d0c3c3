# Follows joeynmt joeynmt/search.py beam_search (tile(src_mask, beam_size, dim=0), trg_mask=None, decoder re-run
# on the whole prefix every step) and joeynmt/transformer_layers.py MultiHeadedAttention (mask True = keep,
# masked_fill(~mask, -inf)) with subsequent_mask(size) = tril ones. src_mask: (B,1,S), right-padded source.
import torch
torch.manual_seed(0); dt = torch.float64; D = 16; nh = 2; hd = D // nh; V = 11
def lin(): return torch.randn(D, D, dtype=dt) / 4
Sq, Sk, Sv, So, Cq, Ck, Cv, Co = [lin() for _ in range(8)]
emb = torch.randn(V, D, dtype=dt); outW = torch.randn(D, V, dtype=dt)

def mha(q, k, v, W, mask):  # mask: (B,1,S) or (B,T,S), True = keep
    Wq, Wk, Wv, Wo = W; B, T, _ = q.shape; S = k.shape[1]
    Q = (q @ Wq).view(B, T, nh, hd).transpose(1, 2) / hd ** 0.5
    K = (k @ Wk).view(B, S, nh, hd).transpose(1, 2); Vv = (v @ Wv).view(B, S, nh, hd).transpose(1, 2)
    sc = Q @ K.transpose(2, 3)
    if mask is not None: sc = sc.masked_fill(~mask.unsqueeze(1), float("-inf"))
    return (sc.softmax(-1) @ Vv).transpose(1, 2).reshape(B, T, D) @ Wo

def subsequent_mask(size):
    return torch.ones(1, size, size, dtype=torch.bool).tril()

def decoder(trg_ids, mem, src_mask):
    x = emb[trg_ids]
    trg_mask = subsequent_mask(trg_ids.size(1))   # joeynmt passes trg_mask=None at inference -> only subsequent
    x = x + mha(x, x, x, (Sq, Sk, Sv, So), trg_mask)
    x = x + mha(x, mem, mem, (Cq, Ck, Cv, Co), src_mask)
    return (x @ outW).log_softmax(-1)

def tile(x, count, dim=0):  # joeynmt.helpers.tile
    return x.repeat_interleave(count, dim)

B, S, beam, steps, bos = 2, 6, 3, 4, 1
src_len = torch.tensor([6, 3])
mem = torch.randn(B, S, D, dtype=dt)
src_mask = (torch.arange(S)[None] < src_len[:, None]).unsqueeze(1)   # (B,1,S) True = real token
mem_t, mask_t = tile(mem, beam), tile(src_mask, beam)
alive = torch.full((B * beam, 1), bos)
topk_log = torch.zeros(B, beam, dtype=dt); topk_log[:, 1:] = float("-inf")
for step in range(steps):
    logp = decoder(alive, mem_t, mask_t)[:, -1]                     # full recompute, keep last row only
    cur = (logp.view(B, beam, V) + topk_log[..., None]).view(B, -1)
    topk_log, ids = cur.topk(beam, -1)
    par = (ids // V + torch.arange(B)[:, None] * beam).view(-1); tok = (ids % V).view(-1, 1)
    alive = torch.cat([alive.index_select(0, par), tok], -1)

# reference: each final hypothesis scored alone with its unpadded source, no mask at all
md = 0.0
for r in range(B * beam):
    b = r // beam; m = mem[b:b + 1, : src_len[b]]
    lp = decoder(alive[r:r + 1], m, None)
    score = lp[0, torch.arange(steps), alive[r, 1:]].sum()
    md = max(md, (score - topk_log.view(-1)[r]).abs().item())
print("max diff", md); assert md < 1e-10
