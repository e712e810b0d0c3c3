"""ChatGLM-6B (GLM): the prompt up to [gMASK] is bidirectional, generated tokens are causal, 2-D positions.

Follows THUDM/ChatGLM-6B modeling_chatglm.py (ChatGLMModel.get_masks: ones(L, L).tril_(), then
attention_mask[:, :context_length] = 1 where context_length is the index of the bos token; get_position_ids with
position_encoding_2d: position_ids = arange(context_length) then mask_position repeated for every generated
token, block_position_ids = 0 over the context then 1, 2, 3, ...; prepare_inputs_for_generation with past:
only the newest token, mask all-visible, position [mask_position, block index]).

So context tokens see the whole context, including tokens to their right (prefix LM by design), and a
generated token's first position id is the [gMASK] position, not its index.  Generation caches the context's
keys once.  Reference: full recompute every step with get_masks / get_position_ids on the whole sequence, no
cache; logits must agree to ~0.  Also checks the context outputs move when a later context token changes
(bidirectional) and do not move when a generated token changes.
"""
import math
import torch

torch.manual_seed(0)
torch.set_default_dtype(torch.float64)
V, E, H, L, MAXPOS = 40, 32, 4, 2, 32
D = E // H
GMASK, BOS = 38, 39
emb, pos_a, pos_b = torch.nn.Embedding(V, E), torch.nn.Embedding(MAXPOS, E // 2), torch.nn.Embedding(MAXPOS, E // 2)
W = [[torch.randn(E, E) / math.sqrt(E) for _ in range(4)] for _ in range(L)]
head = torch.randn(E, V) / math.sqrt(E)


def get_masks(ids):
    context_length = ids.index(BOS)
    m = torch.ones(len(ids), len(ids)).tril_()
    m[:, :context_length] = 1
    return m.bool()  # True = may attend


def get_position_ids(ids):
    context_length, mask_position = ids.index(BOS), ids.index(GMASK)
    position_ids = list(range(context_length)) + [mask_position] * (len(ids) - context_length)
    block_position_ids = [0] * context_length + list(range(1, len(ids) - context_length + 1))
    return torch.tensor(position_ids), torch.tensor(block_position_ids)


def forward(ids, pos, bpos, mask, cache=None):
    x = emb(ids) + torch.cat([pos_a(pos), pos_b(bpos)], -1)  # 2-D position encoding, one half each
    T = ids.shape[0]
    for l, (wq, wk, wv, wo) in enumerate(W):
        q, k, v = ((x @ w).view(T, H, D).transpose(0, 1) for w in (wq, wk, wv))
        if cache is not None:
            if len(cache) > l:
                k, v = torch.cat([cache[l][0], k], 1), torch.cat([cache[l][1], v], 1)
                cache[l] = (k, v)
            else:
                cache.append((k, v))
        s = (q @ k.transpose(-1, -2) / math.sqrt(D)).masked_fill(~mask, float("-inf"))
        x = torch.tanh(x + (torch.softmax(s, -1) @ v).transpose(0, 1).reshape(T, E) @ wo)
    return x @ head


max_diff, bidir, causal_leak = 0.0, 0.0, 0.0
for prompt in ([5, 9, GMASK, 12, 7], [21, 3, 8, 30, GMASK]):
    ids = prompt + [BOS]
    cache = []
    p, bp = get_position_ids(ids)
    logits = forward(torch.tensor(ids), p, bp, get_masks(ids), cache)[-1]
    for step in range(6):
        ref = forward(torch.tensor(ids), *get_position_ids(ids), get_masks(ids))[-1]  # no cache, full mask
        max_diff = max(max_diff, (logits - ref).abs().max().item())
        ids = ids + [int(logits.argmax())]
        p, bp = get_position_ids(ids)
        n = len(ids)
        logits = forward(torch.tensor(ids[-1:]), p[-1:], bp[-1:], torch.ones(1, n, dtype=torch.bool), cache)[-1]
    # context is bidirectional: changing its last token moves its first position's output
    full = forward(torch.tensor(ids), *get_position_ids(ids), get_masks(ids))
    ids2 = list(ids)
    ids2[len(prompt) - 1] = 1 if ids2[len(prompt) - 1] != 1 else 2
    if GMASK in ids2:
        bidir = max(bidir, (forward(torch.tensor(ids2), *get_position_ids(ids2), get_masks(ids2))[0] - full[0])
                    .abs().max().item())
    ids3 = ids[:-1] + [(ids[-1] + 1) % 38]
    out3 = forward(torch.tensor(ids3), *get_position_ids(ids3), get_masks(ids3))
    causal_leak = max(causal_leak, (out3[:-1] - full[:-1]).abs().max().item())

print("max |cached generate - full recompute with get_masks|:", max_diff)
print("context bidirectional effect (> 0):", bidir, " last generated token leaking backwards:", causal_leak)
assert max_diff < 1e-12 and bidir > 1e-6 and causal_leak == 0.0
