# Follows jason9693/MusicTransformer-pytorch custom/layers.py (RelativeGlobalAttention._skewing, _qe_masking):
# QE^T is masked (lower-left kept by sequence_mask), padded left, reshaped and sliced so Srel[i,j] = q_i . E[L-1-(i-j)];
# then the causal look-ahead mask (1 = masked, from utils.get_masked_with_pad_tensor) is added as mask * -1e9.
import torch, torch.nn.functional as F
torch.manual_seed(0); torch.set_default_dtype(torch.float64)
B, L, D, max_seq = 2, 10, 16, 12
q, k, v = torch.randn(B, L, D), torch.randn(B, L, D), torch.randn(B, L, D)
E_full = torch.randn(max_seq, D)

def qe_masking(qe):
    mask = torch.arange(qe.shape[-1])[None, :] >= (qe.shape[-1] - 1 - torch.arange(qe.shape[-2]))[:, None]  # sequence_mask
    return mask.to(qe.dtype) * qe

def skewing(t):
    padded = F.pad(t, [1, 0])
    reshaped = padded.reshape(-1, padded.shape[-1], padded.shape[-2])
    Srel = reshaped[:, 1:, :]
    return Srel

E = E_full[max_seq - L:]                       # _get_left_embedding
QE = qe_masking(q @ E.T)
Srel = skewing(QE)
look_ahead = torch.triu(torch.ones(L, L), diagonal=1)   # 1 = masked
logits = (q @ k.transpose(1, 2) + Srel) / D ** 0.5 + look_ahead * -1e9
out = logits.softmax(-1) @ v

ref = torch.empty_like(out)
for b in range(B):
    for i in range(L):
        s = torch.stack([q[b, i] @ k[b, j] + q[b, i] @ E[L - 1 - (i - j)] for j in range(i + 1)]) / D ** 0.5
        ref[b, i] = s.softmax(0) @ v[b, : i + 1]
diff = (out - ref).abs().max().item()
print("max diff", diff)
assert diff < 1e-12
