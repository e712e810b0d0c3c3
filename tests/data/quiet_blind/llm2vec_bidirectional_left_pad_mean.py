# Follows McGill-NLP/llm2vec (bidirectional Llama: causal mask replaced by a padding-only 4D mask) and
# LLM2Vec.get_pooling mean over attention_mask with left padding. Float bias, 0 keep / min pad; pad query rows discarded.
import torch, torch.nn.functional as F
torch.manual_seed(0); torch.set_default_dtype(torch.float64)
D, H = 32, 4
Wq, Wk, Wv = (torch.randn(D, D) / D**.5 for _ in range(3))
def sp(t): return t.view(t.shape[0], -1, H, D // H).transpose(1, 2)
def enc(x, am):
    T = x.shape[1]
    pos = (am.cumsum(1) - 1).clamp(min=0)
    x = x + 0.1 * torch.cos(pos[..., None].double() * torch.arange(D) / D)
    bias = torch.zeros(x.shape[0], 1, T, T).masked_fill(~am.bool()[:, None, None, :], torch.finfo(x.dtype).min)
    return F.scaled_dot_product_attention(sp(x @ Wq), sp(x @ Wk), sp(x @ Wv), attn_mask=bias).transpose(1, 2).flatten(2)
seqs = [torch.randn(n, D) for n in (6, 2, 4)]; L = 6
x = torch.stack([F.pad(s, (0, 0, L - len(s), 0)) for s in seqs])
am = torch.stack([torch.arange(L) >= L - len(s) for s in seqs]).long()
h = enc(x, am)
emb = (h * am[..., None]).sum(1) / am.sum(1, keepdim=True)
diff = max((enc(s[None], torch.ones(1, len(s), dtype=torch.long)).mean(1) - emb[b]).abs().max().item() for b, s in enumerate(seqs))
print("max diff bidirectional left-padded mean pooling vs alone", diff); assert diff < 1e-10
