"""llm2vec: a decoder-only model made bidirectional, mean pooling that leaves out the instruction tokens.

Follows McGill-NLP/llm2vec, llm2vec/models/bidirectional_llama.py (LlamaBiModel: the causal mask replaced by
the padding mask only, so every real token sees every real token) and llm2vec/llm2vec.py (LLM2Vec.get_pooling:
pooling_mode "mean" over embed_mask, which is 1 only on the text after the instruction; padding is on the left
as in LLM2Vec.tokenize with padding_side="left"). Commit: not pinned. Plain torch, SDPA with a bool mask.
"""
import torch
import torch.nn.functional as F

torch.manual_seed(0)
D, H, L, V = 32, 4, 2, 50
PAD = 0


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.n1 = torch.nn.LayerNorm(D)
        self.qkv = torch.nn.Linear(D, 3 * D)
        self.o = torch.nn.Linear(D, D)
        self.n2 = torch.nn.LayerNorm(D)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(D, 2 * D), torch.nn.GELU(), torch.nn.Linear(2 * D, D))

    def forward(self, x, attn_mask):
        B, T, _ = x.shape
        q, k, v = self.qkv(self.n1(x)).view(B, T, 3, H, D // H).permute(2, 0, 3, 1, 4)
        # bidirectional: is_causal=False, only the padding keys are hidden
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=False)
        x = x + self.o(a.transpose(1, 2).reshape(B, T, D))
        return x + self.mlp(self.n2(x))


class BiDecoder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(V, D)
        self.pos = torch.nn.Embedding(32, D)
        self.blocks = torch.nn.ModuleList(Block() for _ in range(L))

    def forward(self, ids, attention_mask):
        # position ids count real tokens only, so left padding does not shift them
        pos = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        x = self.emb(ids) + self.pos(pos)
        key_ok = attention_mask.bool()[:, None, None, :]  # (B,1,1,T): query rows all see the real keys
        for b in self.blocks:
            x = b(x, key_ok)
        return x


model = BiDecoder().eval().double()

instruction = [3, 4, 5]  # "Retrieve passages that answer the question:"
texts = [[11, 12, 13, 14], [21, 22], [31, 32, 33, 34, 35, 36]]
seqs = [instruction + t for t in texts]


def tokenize(batch_seqs, batch_texts):
    T = max(len(s) for s in batch_seqs)
    ids = torch.full((len(batch_seqs), T), PAD)
    att = torch.zeros(len(batch_seqs), T, dtype=torch.long)
    embed_mask = torch.zeros(len(batch_seqs), T, dtype=torch.long)
    for i, (s, t) in enumerate(zip(batch_seqs, batch_texts)):
        ids[i, T - len(s):] = torch.tensor(s)
        att[i, T - len(s):] = 1
        embed_mask[i, T - len(t):] = 1  # text is the tail of the sequence
    return ids, att, embed_mask


def encode(batch_seqs, batch_texts):
    ids, att, embed_mask = tokenize(batch_seqs, batch_texts)
    with torch.no_grad():
        h = model(ids, att)
    m = embed_mask.unsqueeze(-1).to(h.dtype)
    return (h * m).sum(1) / m.sum(1)


batched = encode(seqs, texts)

# reference: one sequence at a time, no padding, full attention without any mask
ref = []
for s, t in zip(seqs, texts):
    ids = torch.tensor([s])
    with torch.no_grad():
        pos = torch.arange(len(s))[None]
        x = model.emb(ids) + model.pos(pos)
        for b in model.blocks:
            x = b(x, None)
    ref.append(x[0, len(s) - len(t):].mean(0))
ref = torch.stack(ref)
diff = (batched - ref).abs().max().item()
print("max |batched left-padded - unpadded one at a time| =", diff)
assert diff < 1e-10, diff
