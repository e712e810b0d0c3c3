"""Longformer self-attention: sliding window + global CLS with its own q/k/v, padded batch.

Follows huggingface/transformers src/transformers/models/longformer/modeling_longformer.py:
LongformerModel._pad_to_window_size (input padded with pad tokens and attention_mask 0 up to a multiple
of attention_window), LongformerModel.forward (attention_mask * (global_attention_mask + 1): 0 pad,
1 local, 2 global; for sequence classification the global mask is set on the CLS token,
LongformerForSequenceClassification) and LongformerSelfAttention.forward (every token attends to keys
with |i - j| <= attention_window / 2 and to all global keys, masked keys removed; global queries are
recomputed with query_global / key_global / value_global over every real key; outputs of padded
queries zeroed). Written densely with boolean SDPA masks. Reference: each document alone, unpadded,
one query at a time over an explicit list of keys, hand-written softmax.
"""
import torch
import torch.nn.functional as F

torch.manual_seed(0)
D, H, HD, V, NL = 32, 2, 16, 40, 2
WINDOW = 4            # config.attention_window (two-sided), one-sided w = 2
w = WINDOW // 2
lengths = [11, 5, 8]
docs = [torch.cat([torch.tensor([1]), torch.randint(3, V, (n - 1,))]) for n in lengths]  # token 1 = <s>/CLS

emb = torch.nn.Embedding(V, D).double()
pos_emb = torch.nn.Embedding(32, D).double()
mk = lambda: torch.nn.Linear(D, H * HD).double()
layers = [dict(q=mk(), k=mk(), v=mk(), qg=mk(), kg=mk(), vg=mk(), o=torch.nn.Linear(H * HD, D).double())
          for _ in range(NL)]


def heads(x):
    b, n, _ = x.shape
    return x.view(b, n, H, HD).transpose(1, 2)


def batched(ids, am):
    b, n = ids.shape
    valid, glob = am > 0, am == 2
    i = torch.arange(n)
    local = (i[:, None] - i[None, :]).abs() <= w
    m_local = (local[None] | glob[:, None, :]) & valid[:, None, :]
    m_glob = valid[:, None, :].expand(b, n, n)
    h = emb(ids) + pos_emb(i)
    for ly in layers:
        o = F.scaled_dot_product_attention(heads(ly["q"](h)), heads(ly["k"](h)), heads(ly["v"](h)), attn_mask=m_local[:, None])
        og = F.scaled_dot_product_attention(heads(ly["qg"](h)), heads(ly["kg"](h)), heads(ly["vg"](h)), attn_mask=m_glob[:, None])
        o = torch.where(glob[:, None, :, None], og, o)
        o = o.masked_fill(~valid[:, None, :, None], 0.0)
        h = h + ly["o"](o.transpose(1, 2).reshape(b, n, H * HD))
    return h


def reference(ids, glob_idx):
    n = ids.shape[0]
    h = emb(ids) + pos_emb(torch.arange(n))
    for ly in layers:
        rows = []
        for i in range(n):
            if i in glob_idx:
                q, K, Vv, keys = ly["qg"](h[i]), ly["kg"](h), ly["vg"](h), list(range(n))
            else:
                q, K, Vv = ly["q"](h[i]), ly["k"](h), ly["v"](h)
                keys = sorted(set(range(max(0, i - w), min(n, i + w + 1))) | set(glob_idx))
            q, K, Vv = q.view(H, HD), K[keys].view(-1, H, HD), Vv[keys].view(-1, H, HD)
            s = torch.einsum("hd,khd->hk", q, K) / HD ** 0.5
            rows.append(torch.einsum("hk,khd->hd", torch.softmax(s, -1), Vv).reshape(H * HD))
        h = h + ly["o"](torch.stack(rows))
    return h


with torch.no_grad():
    L = max(lengths)
    L += (WINDOW - L % WINDOW) % WINDOW  # _pad_to_window_size
    ids = torch.zeros(len(docs), L, dtype=torch.long)
    attention_mask = torch.zeros(len(docs), L, dtype=torch.long)
    for b, d in enumerate(docs):
        ids[b, :len(d)] = d; attention_mask[b, :len(d)] = 1
    global_attention_mask = torch.zeros_like(attention_mask); global_attention_mask[:, 0] = 1
    out = batched(ids, attention_mask * (global_attention_mask + 1))
    maxdiff = max((out[b, :len(d)] - reference(d, [0])).abs().max().item() for b, d in enumerate(docs))
print("padded length", L, " max |batched dense masks - per-document key lists| =", maxdiff)
assert maxdiff < 1e-10
