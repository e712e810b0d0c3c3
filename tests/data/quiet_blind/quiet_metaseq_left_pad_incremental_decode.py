# Correct program. Ported from facebookresearch/metaseq metaseq/sequence_generator.py and
# metaseq/models/transformer_decoder.py (left-padded prompts, incremental_state KV cache, self_attn_padding_mask).
import torch, torch.nn.functional as F
torch.manual_seed(0)
V, D, H, PAD = 20, 16, 2, 1
emb = torch.nn.Embedding(V, D); pos = torch.nn.Embedding(32, D)
qkv = torch.nn.Linear(D, 3 * D); out = torch.nn.Linear(D, V)

def step(tokens, positions, pad_mask, incremental_state):
    x = emb(tokens) + pos(positions)
    q, k, v = qkv(x).chunk(3, -1)
    if "k" in incremental_state:
        k = torch.cat([incremental_state["k"], k], 1); v = torch.cat([incremental_state["v"], v], 1)
    incremental_state["k"], incremental_state["v"] = k, v
    T, S = q.shape[1], k.shape[1]
    causal = torch.triu(torch.full((T, S), float("-inf")), S - T + 1)
    bias = causal[None].expand(q.shape[0], T, S).clone()
    bias = bias.masked_fill(pad_mask[:, None, :S], float("-inf"))
    sp = lambda t: t.view(t.shape[0], t.shape[1], H, -1).transpose(1, 2)
    a = F.scaled_dot_product_attention(sp(q), sp(k), sp(v), attn_mask=bias[:, None])
    return out(a.transpose(1, 2).reshape(x.shape))[:, -1]

def make_positions(tokens):
    m = tokens.ne(PAD).int()
    return (torch.cumsum(m, 1) * m).long() + PAD

prompts = [[5, 6, 7, 8], [9, 3]]
L = max(map(len, prompts))
tokens = torch.tensor([[PAD] * (L - len(p)) + p for p in prompts])
state = {}; pad_mask = tokens.eq(PAD); positions = make_positions(tokens)
logits = step(tokens, positions, pad_mask, state)
gen = [[] for _ in prompts]
for t in range(4):
    nxt = logits.argmax(-1)
    for i in range(len(prompts)): gen[i].append(nxt[i].item())
    pad_mask = torch.cat([pad_mask, torch.zeros(len(prompts), 1, dtype=torch.bool)], 1)
    positions = positions[:, -1:] + 1
    logits = step(nxt[:, None], positions, pad_mask, state)

for i, p in enumerate(prompts):   # reference: one unpadded sequence, full recompute each step
    seq = list(p)
    for t in range(4):
        x = torch.tensor([seq])
        lg = step(x, make_positions(x), x.eq(PAD), {})
        seq.append(lg.argmax(-1).item())
    assert seq[len(p):] == gen[i], (seq, gen[i])
print("ok", gen)
