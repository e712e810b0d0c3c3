# Follows THUDM/GLM model/modeling_glm.py (GLMModel.forward -> build_mask_matrix(seq_length, sep)): Part A
# (columns < sep) is bidirectional for every row, Part B is causal; sep differs per sample, Part B right-padded.
import torch
torch.manual_seed(0)
B, T, D = 3, 12, 16
seps = torch.tensor([5, 3, 7])
lens = torch.tensor([12, 9, 10])          # rows >= len are padding, their outputs discarded

def build_mask_matrix(seq_length, sep):
    m = torch.ones((1, seq_length, seq_length), dtype=torch.float64)
    m = torch.tril(m)
    m = m.expand(sep.size(0), -1, -1)
    ids = torch.arange(seq_length, device=sep.device).unsqueeze(0).expand(sep.size(0), -1)
    mask = ids < sep.view(-1, 1)
    m = m.masked_fill(mask.unsqueeze(1).expand_as(m), 1)
    return m.unsqueeze(1)                 # [B,1,T,T], 1 = attend

x = torch.randn(B, T, D, dtype=torch.float64)
Wq, Wk, Wv = (torch.randn(D, D, dtype=torch.float64) / 4 for _ in range(3))
m = build_mask_matrix(T, seps)
q, k, v = x @ Wq, x @ Wk, x @ Wv
s = (q @ k.transpose(-1, -2) / D ** 0.5).unsqueeze(1)
s = s * m - 10000.0 * (1.0 - m)           # GLM's own masking style
out = (torch.softmax(s, -1) @ v.unsqueeze(1)).squeeze(1)

diff = 0.0
for b in range(B):
    L, sep = lens[b].item(), seps[b].item()
    xb = x[b, :L]
    for i in range(L):
        js = [j for j in range(L) if j < sep or j <= i]
        r = torch.softmax((xb[js] @ Wk) @ (xb[i] @ Wq) / D ** 0.5, 0) @ (xb[js] @ Wv)
        diff = max(diff, (r - out[b, i]).abs().max().item())
print("max diff", diff)
assert diff < 1e-12
