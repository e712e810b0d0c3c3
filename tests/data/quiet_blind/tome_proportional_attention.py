# Follows facebookresearch/ToMe tome/patch/timm.py ToMeAttention.forward: "Apply proportional attention",
# attn = attn + size.log()[:, None, None, :, 0], where size counts how many patches a merged token stands for
# (tome/merge.py merge_wavg).  log(size) is a float bias, never -inf, so no key is masked.
import torch

torch.manual_seed(0)
dt = torch.float64
B, N, C, Hh = 2, 11, 32, 4
hd = C // Hh
x = torch.randn(B, N, C, dtype=dt)
size = torch.randint(1, 5, (B, N, 1)).to(dt)
size[:, 0] = 1.0                                       # CLS never merged
qkv_w = torch.randn(C, 3 * C, dtype=dt) / C ** 0.5


def tome_attention(x, size):
    B, N, C = x.shape
    qkv = (x @ qkv_w).reshape(B, N, 3, Hh, hd).permute(2, 0, 3, 1, 4)
    q, k, v = qkv[0], qkv[1], qkv[2]
    attn = (q @ k.transpose(-2, -1)) * hd ** -0.5
    if size is not None:
        attn = attn + size.log()[:, None, None, :, 0]
    attn = attn.softmax(dim=-1)
    return (attn @ v).transpose(1, 2).reshape(B, N, C)


out = tome_attention(x, size)
# reference: undo the merge -- a token of size s is s identical patches; plain attention over them
diff = 0.0
for b in range(B):
    reps = size[b, :, 0].long()
    x_full = torch.repeat_interleave(x[b], reps, dim=0)[None]
    ref_full = tome_attention(x_full, None)[0]
    first = torch.cumsum(reps, 0) - reps                  # first copy of each merged token
    diff = max(diff, (out[b] - ref_full[first]).abs().max().item())
print("max |size-weighted attention - attention over unmerged copies| =", diff)
assert diff < 1e-12
