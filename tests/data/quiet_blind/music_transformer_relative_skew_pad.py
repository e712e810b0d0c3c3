# Follows jason9693/MusicTransformer-pytorch custom/layers.py (RelativeGlobalAttention._skewing) and utils.py
# (get_masked_with_pad_tensor: look-ahead | pad, 1 = masked, applied as logits += mask * -1e9). Right-padded events.
import torch
torch.manual_seed(0)
B, T, D, pad = 2, 10, 16, 0
lens = [10, 6]
E = torch.randn(T, D, dtype=torch.float64)                 # relative embeddings for distances T-1 .. 0
x = torch.randn(B, T, D, dtype=torch.float64)
Wq, Wk, Wv = (torch.randn(D, D, dtype=torch.float64) / 4 for _ in range(3))
tokens = torch.ones(B, T, dtype=torch.long)
for b, L in enumerate(lens):
    tokens[b, L:] = pad
def _skewing(t):
    padded = torch.nn.functional.pad(t, [1, 0])
    srel = padded.reshape(-1, t.shape[-1] + 1, t.shape[-2])[:, 1:]
    return srel.reshape(t.shape)
q, k, v = x @ Wq, x @ Wk, x @ Wv
QE = _skewing(q @ E.t())
look_ahead = torch.triu(torch.ones(T, T), diagonal=1)
pad_mask = (tokens == pad).double()[:, None, :]
mask = torch.maximum(look_ahead[None], pad_mask)           # 1 = masked
logits = (q @ k.transpose(1, 2) + QE) / D ** 0.5 + mask * -1e9
out = torch.softmax(logits, -1) @ v
diff = 0.0
for b, L in enumerate(lens):
    for i in range(L):
        js = torch.arange(i + 1)
        rel = (q[b, i] @ E[T - 1 - (i - js)].t())          # distance i-j uses E row T-1-(i-j)
        w = torch.softmax((k[b, js] @ q[b, i] + rel) / D ** 0.5, 0)
        diff = max(diff, (w @ v[b, js] - out[b, i]).abs().max().item())
print("max diff", diff)
assert diff < 1e-12
