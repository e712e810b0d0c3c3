# Follows intfloat/e5-mistral-7b-instruct README last_token_pool (and sentence-transformers lasttoken pooling):
# causal encoder; if every row ends with a real token (left padding) take [:, -1], else gather at mask.sum-1.
# Left- and right-padded batches vs each text alone; masks: causal & key padding, True = attend.
import torch, torch.nn.functional as F
torch.manual_seed(0); torch.set_default_dtype(torch.float64)
D, H = 32, 4
Wq, Wk, Wv = (torch.randn(D, D) / D**.5 for _ in range(3))
def sp(t): return t.view(t.shape[0], -1, H, D // H).transpose(1, 2)
def enc(x, am, pos):
    x = x + 0.1 * torch.sin(pos[..., None].double() + torch.arange(D))
    T = x.shape[1]; keep = torch.tril(torch.ones(T, T, dtype=torch.bool))[None] & am.bool()[:, None, :]
    keep = keep | torch.eye(T, dtype=torch.bool)  # fully padded rows (left pad) see themselves; discarded later
    return F.scaled_dot_product_attention(sp(x @ Wq), sp(x @ Wk), sp(x @ Wv), attn_mask=keep[:, None]).transpose(1, 2).flatten(2)
def last_token_pool(h, am):
    if am[:, -1].sum() == am.shape[0]: return h[:, -1]
    n = am.sum(1) - 1; return h[torch.arange(h.shape[0]), n]
seqs = [torch.randn(n, D) for n in (7, 3, 5)]; L = 7
diff = 0.0
for side in ("left", "right"):
    x = torch.stack([F.pad(s, (0, 0, L - len(s), 0) if side == "left" else (0, 0, 0, L - len(s))) for s in seqs])
    am = torch.stack([(torch.arange(L) >= L - len(s)) if side == "left" else (torch.arange(L) < len(s)) for s in seqs]).long()
    pos = (am.cumsum(1) - 1).clamp(min=0)
    e = last_token_pool(enc(x, am, pos), am)
    for b, s in enumerate(seqs):
        r = enc(s[None], torch.ones(1, len(s)), torch.arange(len(s))[None])[:, -1]
        diff = max(diff, (r - e[b]).abs().max().item())
print("max diff last-token pooling (left and right padding) vs alone", diff); assert diff < 1e-10
