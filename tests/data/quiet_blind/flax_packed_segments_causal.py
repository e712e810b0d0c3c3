# flax flax/linen/attention.py make_attention_mask(segment_ids, segment_ids, jnp.equal) & make_causal_mask, combined via
# combine_masks (as in T5X decoder packing); 1 = attend. Segment id 0 = padding: pad rows see only pad keys, discarded.
import numpy as np
rng = np.random.default_rng(0)
D, L = 16, 14
seg = np.array([1, 1, 1, 1, 2, 2, 2, 3, 3, 3, 3, 3, 0, 0])
def make_attention_mask(qi, ki, fn): return fn(qi[:, None], ki[None, :]).astype(np.float64)
causal = make_attention_mask(np.arange(L), np.arange(L), np.greater_equal)
mask = np.logical_and(make_attention_mask(seg, seg, np.equal), causal).astype(np.float64)
Wq, Wk, Wv = (rng.standard_normal((D, D)) / D**0.5 for _ in range(3))
x = rng.standard_normal((L, D))
def attend(x, m):
    s = (x @ Wq) @ (x @ Wk).T / np.sqrt(D)
    s = np.where(m > 0, s, np.finfo(np.float64).min)   # dot_product_attention_weights uses big negative bias
    w = np.exp(s - s.max(-1, keepdims=True)); w /= w.sum(-1, keepdims=True)
    return w @ (x @ Wv)
out = attend(x, mask)
d = 0.0
for sid in (1, 2, 3):
    idx = np.where(seg == sid)[0]
    ref = attend(x[idx], np.tril(np.ones((len(idx), len(idx)))))
    d = max(d, np.abs(out[idx] - ref).max())
print("max diff packed vs each document alone:", d); assert d < 1e-10
