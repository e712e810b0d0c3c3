"""Assisted (speculative) greedy decoding: the target verifies several draft tokens in one cached forward.

Follows huggingface/transformers src/transformers/generation/utils.py (GenerationMixin._assisted_decoding) with
src/transformers/generation/candidate_generator.py (AssistedCandidateGenerator.get_candidates) and
DynamicCache.crop: a small draft model proposes K tokens greedily; the target model is run once on the
candidate tokens with its KV cache, so the attention has more keys than queries (cache + candidates) and the
mask is causal aligned to the lower right by cache_position (query i may see key j iff j <= cache_position[i]).
The longest prefix of matching drafts plus the target's own next token is accepted; both caches are cropped to
the accepted length, dropping the rejected drafts' keys.

Reference: plain greedy decoding of the target without any cache (full causal recompute each step).  The token
sequences must be identical and the verified logits must match the uncached ones to ~0.
"""
import math
import torch
import torch.nn.functional as F

torch.manual_seed(0)
torch.set_default_dtype(torch.float64)
V, MAXLEN = 13, 64


class TinyLM(torch.nn.Module):
    def __init__(self, E, H, L):
        super().__init__()
        self.H, self.D = H, E // H
        self.emb = torch.nn.Embedding(V, E)
        self.pos = torch.nn.Embedding(MAXLEN, E)
        self.qkv = torch.nn.ModuleList(torch.nn.Linear(E, 3 * E) for _ in range(L))
        self.o = torch.nn.ModuleList(torch.nn.Linear(E, E) for _ in range(L))
        self.head = torch.nn.Linear(E, V)

    def forward(self, ids, cache=None, cache_position=None):
        T = ids.shape[1]
        if cache_position is None:
            cache_position = torch.arange(T)
        x = self.emb(ids) + self.pos(cache_position)
        for l, (qkv, o) in enumerate(zip(self.qkv, self.o)):
            q, k, v = qkv(x).view(1, T, 3, self.H, self.D).permute(2, 0, 3, 1, 4)
            if cache is not None:
                if len(cache) > l:
                    k = torch.cat([cache[l][0], k], 2)
                    v = torch.cat([cache[l][1], v], 2)
                    cache[l] = (k, v)
                else:
                    cache.append((k, v))
            kpos = torch.arange(k.shape[2])
            mask = kpos[None, :] <= cache_position[:, None]  # causal, lower-right by cache position
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            x = x + o(a.transpose(1, 2).reshape(1, T, -1))
        return self.head(x)


def crop(cache, n):
    for l in range(len(cache)):
        cache[l] = (cache[l][0][:, :, :n], cache[l][1][:, :, :n])


target, draft = TinyLM(32, 4, 3), TinyLM(32, 4, 3)
with torch.no_grad():  # the draft is a perturbed copy, so some drafts are accepted and some rejected
    for pt, pd in zip(target.parameters(), draft.parameters()):
        pd.copy_(pt + 0.3 * torch.randn_like(pt))
prompt = torch.tensor([[3, 7, 1, 9, 4]])
NEW, K = 14, 3

# reference: no cache, full recompute
ref = prompt.clone()
ref_logits = []
for _ in range(NEW):
    lg = target(ref)[:, -1]
    ref_logits.append(lg)
    ref = torch.cat([ref, lg.argmax(-1, keepdim=True)], 1)

# assisted decoding with caches
tc, dc = [], []
ids = prompt.clone()
lg = target(ids, tc)[:, -1]  # prefill target
got_logits = [lg]
ids = torch.cat([ids, lg.argmax(-1, keepdim=True)], 1)
draft(ids[:, :-1], dc)  # prefill draft on all but the newest token
max_diff, verify_calls = 0.0, 0
while ids.shape[1] < prompt.shape[1] + NEW:
    n = ids.shape[1]
    cand = ids
    for _ in range(K):  # draft proposes K tokens greedily, one at a time with its cache
        c = len(dc) and dc[0][0].shape[2]
        dl = draft(cand[:, c:], dc, torch.arange(c, cand.shape[1]))[:, -1]
        cand = torch.cat([cand, dl.argmax(-1, keepdim=True)], 1)
    # target verifies: queries are the newest accepted token + K drafts, keys are cache + those
    pos = torch.arange(n - 1, n + K)
    vl = target(cand[:, n - 1:], tc, pos)[0]
    verify_calls += 1
    pred = vl.argmax(-1)
    drafts = cand[0, n:]
    acc = 0
    while acc < K and drafts[acc] == pred[acc]:
        acc += 1
    new = torch.cat([drafts[:acc], pred[acc:acc + 1]])
    got_logits += [vl[i:i + 1] for i in range(acc + 1)]
    ids = torch.cat([ids, new[None]], 1)
    crop(tc, ids.shape[1] - 1)  # keep keys of every accepted token except the newest
    crop(dc, ids.shape[1] - 1)

ids = ids[:, : prompt.shape[1] + NEW]
got_logits = got_logits[:NEW]
max_diff = max((a - b).abs().max().item() for a, b in zip(got_logits, ref_logits))
print("assisted:", ids.tolist())
print("greedy  :", ref.tolist())
print("verify calls:", verify_calls, "for", NEW, "tokens; max |logit diff|:", max_diff)
assert torch.equal(ids, ref) and max_diff < 1e-12
