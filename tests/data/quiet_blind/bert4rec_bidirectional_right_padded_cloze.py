# Follows jaywonchung/BERT4Rec-VAE-Pytorch models/bert_modules/bert.py (BERT.forward):
# mask = (x > 0).unsqueeze(1).repeat(1, x.size(1), 1).unsqueeze(1), and attention/single.py masked_fill(mask == 0, -1e9).
# Bidirectional over a RIGHT-padded history; pad query rows still attend real items and are simply ignored.
import torch, math
torch.manual_seed(1); torch.set_default_dtype(torch.float64)
L, D, H, NITEMS = 12, 32, 4, 30
MASK_TOKEN = NITEMS + 1
tok = torch.nn.Embedding(NITEMS + 2, D, padding_idx=0); pos = torch.nn.Embedding(L, D)
Wq, Wk, Wv, Wo = (torch.nn.Linear(D, D) for _ in range(4))
ln1, ln2 = torch.nn.LayerNorm(D), torch.nn.LayerNorm(D)
ff = torch.nn.Sequential(torch.nn.Linear(D, 2 * D), torch.nn.GELU(), torch.nn.Linear(2 * D, D))
out_head = torch.nn.Linear(D, NITEMS + 1)

def attention(q, k, v, mask):                      # attention/single.py
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))
    scores = scores.masked_fill(mask == 0, -1e9)
    return torch.softmax(scores, dim=-1) @ v

def bert(x):
    mask = (x > 0).unsqueeze(1).repeat(1, x.size(1), 1).unsqueeze(1)       # (B,1,L,L), 1 = keep key
    h = tok(x) + pos(torch.arange(x.size(1)))
    B, T, _ = h.shape
    sp = lambda t: t.view(B, T, H, D // H).transpose(1, 2)
    a = attention(sp(Wq(h)), sp(Wk(h)), sp(Wv(h)), mask).transpose(1, 2).reshape(B, T, D)
    h = ln1(h + Wo(a)); h = ln2(h + ff(h))
    return out_head(h)

lens = [12, 7, 4, 2]
seqs = [torch.randint(1, NITEMS + 1, (n,)) for n in lens]
for s in seqs:
    s[-1] = MASK_TOKEN                                  # cloze: predict the next item at the last slot
x = torch.zeros(len(lens), L, dtype=torch.long)
for b, s in enumerate(seqs):
    x[b, :len(s)] = s                                   # right padding
with torch.no_grad():
    logits = bert(x)
    diff = 0.0
    for b, s in enumerate(seqs):
        ref = bert(s[None])[0]
        diff = max(diff, (logits[b, :len(s)] - ref).abs().max().item())
print("max diff right-padded batch vs each history alone:", diff)
assert diff < 1e-10
