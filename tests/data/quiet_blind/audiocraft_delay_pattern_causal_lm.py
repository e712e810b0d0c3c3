# audiocraft audiocraft/modules/codebooks_patterns.py DelayedPatternProvider (codebook k delayed by k steps, special token
# fills holes) + LMModel causal mask over pattern steps; revert_pattern_sequence drops fill slots. Checked vs cached decode.
import torch, torch.nn.functional as F
torch.manual_seed(0); torch.set_default_dtype(torch.float64)
Kc, T, card, D = 4, 6, 16, 32
SPECIAL = card                                          # audiocraft uses card as the special/pad token id
codes = torch.randint(0, card, (1, Kc, T))
delays = list(range(Kc)); S = T + max(delays) + 1       # step 0 is all-special (start), like pattern with 1 leading step
seq = torch.full((1, Kc, S), SPECIAL)
for k, dl in enumerate(delays):
    seq[0, k, 1 + dl:1 + dl + T] = codes[0, k]
emb = torch.randn(Kc, card + 1, D) / D**0.5
Wq, Wk, Wv = (torch.randn(D, D) / D**0.5 for _ in range(3)); heads = torch.randn(Kc, D, card)
x = sum(emb[k][seq[:, k]] for k in range(Kc))           # sum of codebook embeddings per step (LMModel.forward)
q, k_, v = x @ Wq, x @ Wk, x @ Wv
causal = torch.ones(S, S, dtype=torch.bool).tril()       # True = keep
h = F.scaled_dot_product_attention(q, k_, v, attn_mask=causal)
logits = torch.stack([h @ heads[k] for k in range(Kc)], 1)   # (1, Kc, S, card)
# incremental decode with a growing cache: step s sees steps <= s
ks, vs, inc = [], [], []
for s in range(S):
    ks.append(k_[:, s]); vs.append(v[:, s])
    Kc_, Vc_ = torch.stack(ks, 1), torch.stack(vs, 1)
    inc.append(((q[:, s:s + 1] @ Kc_.transpose(1, 2)) / D**0.5).softmax(-1) @ Vc_)
inc = torch.cat(inc, 1)
d = (h - inc).abs().max().item()
# revert pattern: codebook k's logits for frame t live at step t + k (predicting seq step t+k+1); fill slots are dropped
rev = torch.stack([logits[0, k, dl:dl + T] for k, dl in enumerate(delays)])
back = torch.stack([seq[0, k, 1 + dl:1 + dl + T] for k, dl in enumerate(delays)])
assert torch.equal(back, codes[0]) and rev.shape == (Kc, T, card)
print("max diff masked vs incremental:", d); assert d < 1e-10
