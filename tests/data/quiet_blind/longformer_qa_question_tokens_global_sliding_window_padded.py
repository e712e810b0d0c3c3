"""Longformer question answering: question tokens global, context in a sliding window.

Follows huggingface/transformers src/transformers/models/longformer/modeling_longformer.py
(`_compute_global_attention_mask`: for QA every token before the first sep_token is
global; LongformerSelfAttention: one_sided_attn_window_size = attention_window // 2,
global tokens attend to every real token and every token attends to them;
`attention_mask` 0 hides padding), not pinned. Written as one dense boolean mask
(window | key global | query global) & key real, as the model means it; global rows
use the same projections here for brevity. Reference: a per-query loop that builds
each query's key set explicitly. Right-padded batch of two question/context pairs.
"""
import torch
import torch.nn.functional as F

torch.manual_seed(0)
D, H, HD = 32, 4, 8
ATTENTION_WINDOW = 4                       # config.attention_window
W = ATTENTION_WINDOW // 2                  # one side
CLS, SEP, PAD = 0, 2, 1

wq, wk, wv = (torch.nn.Linear(D, D) for _ in range(3))
emb = torch.nn.Embedding(50, D)


def compute_global_attention_mask(input_ids, sep_token_id):
    """transformers' helper: tokens before the first sep are the question."""
    sep_idx = (input_ids == sep_token_id).int().argmax(-1)
    return torch.arange(input_ids.shape[1])[None] < sep_idx[:, None]


def build(question, context, S):
    ids = torch.cat([torch.tensor([CLS]), question, torch.tensor([SEP, SEP]), context,
                     torch.tensor([SEP])])
    pad = torch.full((S - len(ids),), PAD)
    return torch.cat([ids, pad]), torch.cat([torch.ones(len(ids)), torch.zeros(len(pad))]).long()


S = 24
pairs = [(torch.randint(3, 50, (3,)), torch.randint(3, 50, (12,))),
         (torch.randint(3, 50, (5,)), torch.randint(3, 50, (7,)))]
built = [build(q, c, S) for q, c in pairs]
input_ids = torch.stack([b[0] for b in built])
attention_mask = torch.stack([b[1] for b in built])
global_attention_mask = compute_global_attention_mask(input_ids, SEP) & attention_mask.bool()

with torch.no_grad():
    x = emb(input_ids)
    q, k, v = (w(x).view(2, S, H, HD).transpose(1, 2) for w in (wq, wk, wv))

    i = torch.arange(S)
    window = (i[None, :] - i[:, None]).abs() <= W
    key_real = attention_mask.bool()[:, None, :]
    g = global_attention_mask
    allowed = (window[None] | g[:, None, :] | g[:, :, None]) & key_real
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed[:, None])

    worst = 0.0
    for b in range(2):
        n_real = int(attention_mask[b].sum())
        for t in range(n_real):                    # padding queries are never read
            if g[b, t]:
                keys = list(range(n_real))
            else:
                local = range(max(0, t - W), min(n_real, t + W + 1))
                keys = sorted(set(local) | set(torch.nonzero(g[b]).flatten().tolist()))
            kk, vv = k[b, :, keys], v[b, :, keys]
            p = (q[b, :, t:t + 1] @ kk.transpose(-1, -2) / HD ** 0.5).softmax(-1)
            worst = max(worst, ((p @ vv)[:, 0] - out[b, :, t]).abs().max().item())

print("global tokens per row:", g.sum(-1).tolist())
print(f"dense global+window mask vs per-query key sets, max diff {worst:.2e}")
assert worst < 1e-5
