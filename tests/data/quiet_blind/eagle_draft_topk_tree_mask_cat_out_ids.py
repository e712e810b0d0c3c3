# Follows SafeAILab/EAGLE eagle/model/cnets.py Model.topK_genrate: tree_mask starts as tree_mask_init = eye(top_k),
# each depth does tree_mask = cat((tree_mask[:, :, out_ids], tree_mask_init), dim=3) and the draft forward adds
# it to the lower-right of the causal mask (_prepare_decoder_attention_mask), position_ids = len_posi + depth.
import torch
torch.manual_seed(0); dt = torch.float64; D = 32; nh = 2; hd = D // nh; Vsz = 40; top_k = 3; depth = 4
Wq, Wk, Wv, Wo = [torch.randn(D, D, dtype=dt) / 5 for _ in range(4)]
emb = torch.randn(Vsz, D, dtype=dt); head = torch.randn(D, Vsz, dtype=dt)
NEG = torch.finfo(dt).min

def rope(x, pos):
    inv = 1.0 / (10000 ** (torch.arange(0, hd, 2, dtype=dt) / hd))
    f = pos[:, None].to(dt) * inv[None]; e = torch.cat([f, f], -1)
    return x * e.cos() + torch.cat([-x[..., hd // 2:], x[..., : hd // 2]], -1) * e.sin()

def draft(ids, pos, tree_mask=None, past=None):
    x = emb[ids]; L = len(ids)
    q = rope((x @ Wq).view(L, nh, hd).transpose(0, 1), pos)
    k = rope((x @ Wk).view(L, nh, hd).transpose(0, 1), pos); v = (x @ Wv).view(L, nh, hd).transpose(0, 1)
    if past is not None: k = torch.cat([past[0], k], 1); v = torch.cat([past[1], v], 1)
    S = k.shape[1]
    m = torch.full((L, S), NEG, dtype=dt).triu(S - L + 1)          # causal, aligned lower-right
    if tree_mask is not None:
        tm = tree_mask[0, 0]                                       # (L, tree_width)
        m[:, -tm.shape[-1]:][tm == 0] = NEG
    a = (q @ k.transpose(-1, -2)) / hd ** 0.5 + m
    h = (a.softmax(-1) @ v).transpose(0, 1).reshape(L, D) @ Wo
    return h, (k, v)

prompt = torch.randint(0, Vsz, (6,)); len_posi = len(prompt)
h, past = draft(prompt, torch.arange(len_posi))
lp = (h[-1] @ head).log_softmax(-1)
scores, tok = lp.topk(top_k)
tree_mask_init = torch.eye(top_k)[None, None]
tree_mask = tree_mask_init.clone()
paths = [[t.item()] for t in tok]                    # token path of each frontier node
nodes = []                                          # (path, hidden) of every drafted node
input_ids = tok
for d in range(depth):
    pos = torch.full((top_k,), len_posi + d)
    h, past = draft(input_ids, pos, tree_mask, past)
    nodes += [(list(p), h[i]) for i, p in enumerate(paths)]
    lp = (h @ head).log_softmax(-1)
    cu = (scores[:, None] + lp).view(-1)
    scores, idx = cu.topk(top_k)
    out_ids = idx // Vsz                             # parent of each new frontier node
    input_ids = idx % Vsz
    tree_mask = torch.cat((tree_mask[:, :, out_ids], tree_mask_init), dim=3)
    paths = [paths[o] + [input_ids[i].item()] for i, o in enumerate(out_ids.tolist())]
# note: past also holds non-selected siblings; the mask hides them from every later node

# reference: each drafted node's path appended to the prompt, plain causal forward, no cache and no tree
md = 0.0
for path, hn in nodes:
    seq = torch.cat([prompt, torch.tensor(path)])
    hr, _ = draft(seq, torch.arange(len(seq)))
    md = max(md, (hr[-1] - hn).abs().max().item())
print("nodes", len(nodes), "max diff", md); assert md < 1e-10
