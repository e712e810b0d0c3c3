# Follows NVIDIA kvpress: kvpress/presses/adakv_press.py (AdaKVPress.compress: pick pruned keys over all heads jointly,
# with alpha_safeguard per head, store module.masked_key_indices) + kvpress/attention_patch.py (masked keys neutralised).
# Heads keep different numbers of keys, so the cache stays dense and pruned (head, key) pairs get a -inf float bias.
import torch
torch.manual_seed(1)
dt = torch.float64
B, H, T, D, Q = 2, 4, 20, 8, 3
ratio, alpha = 0.6, 0.2

K = torch.randn(B, H, T, D, dtype=dt)
V = torch.randn(B, H, T, D, dtype=dt)
scores = -K.norm(dim=-1) + 2 * torch.randn(B, H, 1, dtype=dt)   # heads on very different scales -> uneven budgets

# AdaKVPress.compress
n_kept = int(H * T * (1 - ratio))
n_safe = int(T * (1 - ratio) * alpha)
top_idx = scores.topk(n_safe, dim=-1).indices
scores = scores.scatter(-1, top_idx, torch.finfo(dt).max)           # safeguard: every head keeps >= n_safe keys
n_pruned = H * T - n_kept
pruned = (-scores.reshape(B, -1)).topk(n_pruned, dim=-1).indices    # over all heads together
b_idx = torch.arange(B).unsqueeze(1).expand(-1, n_pruned)
masked_key_indices = (b_idx, pruned // T, pruned % T)

# attention with a float bias: 0 keep, -inf masked (True in 'masked' means dropped)
masked = torch.zeros(B, H, T, dtype=torch.bool)
masked[masked_key_indices] = True
bias = torch.zeros(B, H, 1, T, dtype=dt).masked_fill(masked.unsqueeze(2), float("-inf"))
q = torch.randn(B, H, Q, D, dtype=dt)
out = torch.nn.functional.scaled_dot_product_attention(q, K, V, attn_mask=bias)

# reference: for each (batch, head) gather only the kept keys and attend densely
ref = torch.empty_like(out)
kept_counts = []
for b in range(B):
    for h in range(H):
        keep = ~masked[b, h]
        kept_counts.append(int(keep.sum()))
        s = q[b, h] @ K[b, h][keep].T / D ** 0.5
        ref[b, h] = torch.softmax(s, -1) @ V[b, h][keep]
print("kept keys per head", kept_counts)
assert len(set(kept_counts)) > 1 and min(kept_counts) >= n_safe
diff = (out - ref).abs().max().item()
print("max diff", diff)
assert diff < 1e-12
