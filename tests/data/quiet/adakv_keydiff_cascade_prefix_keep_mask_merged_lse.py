# Follows AdaKV (FFY0/AdaKV, adaptive budget allocation: one topk over every head's key scores flattened together, so
# each head keeps its own number of keys, with a per-head safeguard) scored as kvpress's KeyDiffPress scores keys
# (minus the cosine similarity of each key to its head's mean key), then a cascade decode as FlashInfer's merge_state
# does it: a question chunk of Q tokens attends the pruned prefix cache in one call (a bool keep mask per (batch, head,
# key), the same row for every query, on hand-written scores) and its own keys causally in another, the two merged by
# their log-sum-exp. Checked against a loop over rows, heads and queries: one softmax over the prefix keys that head
# keeps and the question keys up to that query, gathered and concatenated.
import torch

torch.manual_seed(3)
dt = torch.float64
B, H, T, Q, D = 2, 4, 16, 4, 8
ratio, n_safe = 0.5, 2


def normal(*shape):
    return torch.randn(*shape, dtype=dt)


K, V = normal(B, H, T, D), normal(B, H, T, D)
K = K + 1.5 * normal(B, H, 1, D)  # (each head's keys around a mean of their own: KeyDiff scores spread unevenly)

# AdaKV's allocation over KeyDiff scores
scores = -torch.nn.functional.cosine_similarity(K, K.mean(dim=2, keepdim=True), dim=-1)  # (B, H, T)
safe = scores.topk(n_safe, dim=-1).indices
scores = scores.scatter(-1, safe, torch.finfo(dt).max)  # every head keeps its n_safe best keys
budget = int(H * T * (1 - ratio))
kept = scores.reshape(B, H * T).topk(budget, dim=-1).indices
keep = torch.zeros(B, H * T, dtype=torch.bool).scatter(1, kept, True).view(B, H, T)

q, k_new, v_new = normal(B, H, Q, D), normal(B, H, Q, D), normal(B, H, Q, D)
scale = D ** -0.5


def attend(q, k, v, allowed):
    """softmax(q kᵀ) v over the allowed keys, and the log-sum-exp of those scores (FlashInfer's (v, s) state)."""
    s = torch.einsum("bhqd,bhkd->bhqk", q, k) * scale
    s = s.masked_fill(~allowed, float("-inf"))
    return torch.softmax(s, dim=-1) @ v, torch.logsumexp(s, dim=-1, keepdim=True)


o_prefix, s_prefix = attend(q, K, V, keep[:, :, None, :])
o_own, s_own = attend(q, k_new, v_new, torch.ones(Q, Q, dtype=torch.bool).tril())
top = torch.maximum(s_prefix, s_own)  # merge_state: weights exp(s - max)
w_prefix, w_own = (s_prefix - top).exp(), (s_own - top).exp()
out = (o_prefix * w_prefix + o_own * w_own) / (w_prefix + w_own)

ref = torch.empty_like(out)
counts = []
for b in range(B):
    for h in range(H):
        counts.append(int(keep[b, h].sum()))
        for i in range(Q):
            keys = torch.cat([K[b, h][keep[b, h]], k_new[b, h, : i + 1]])
            values = torch.cat([V[b, h][keep[b, h]], v_new[b, h, : i + 1]])
            ref[b, h, i] = torch.softmax(keys @ q[b, h, i] * scale, dim=0) @ values
print("prefix keys kept per (row, head)", counts)
assert len(set(counts)) > 1 and min(counts) >= n_safe
diff = (out - ref).abs().max().item()
print("max diff", diff)
assert diff < 1e-12
