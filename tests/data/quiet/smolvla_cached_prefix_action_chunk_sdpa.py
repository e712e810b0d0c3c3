# Follows huggingface/lerobot policies/smolvla (VLAFlowMatching.sample_actions / denoise_step) written another way than
# pi0's: an nn.Module with SDPA and a bool mask (True = may attend), the language right padded inside the prefix, the
# prefix's keys and values cached once (position_ids = cumsum(pad_masks) - 1), then every denoising step runs the whole action chunk (bidirectional among
# itself, no state token) over [cached prefix | chunk]. Checked against each sample alone, unpadded, in one pass.
import torch
import torch.nn.functional as F

torch.manual_seed(3)
torch.set_default_dtype(torch.float64)
D, H, IMG, LANG, CHUNK, STEPS = 24, 2, 3, 6, 4, 3


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv, self.out = torch.nn.Linear(D, 3 * D), torch.nn.Linear(D, D)

    def forward(self, x, keep, past=None):
        b, n, _ = x.shape
        q, k, v = (t.view(b, n, H, D // H).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        if past is not None:
            k, v = torch.cat([past[0], k], 2), torch.cat([past[1], v], 2)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None])
        return x + self.out(a.transpose(1, 2).reshape(b, n, D)), (k, v)


blocks = torch.nn.ModuleList(Block() for _ in range(2))
time_mlp = torch.nn.Linear(1, D)
pos = torch.nn.Embedding(32, D)


def run(x, position_ids, keep, past=None):
    x, kept = x + pos(position_ids), []
    for i, block in enumerate(blocks):
        x, kv = block(x, keep, None if past is None else past[i])
        kept.append(kv)
    return x, kept


lengths = [6, 2, 4]
B = len(lengths)
img, lang = torch.randn(B, IMG, D), torch.randn(B, LANG, D)
real = torch.cat([torch.ones(B, IMG, dtype=torch.bool), torch.arange(LANG)[None] < torch.tensor(lengths)[:, None]], 1)
with torch.no_grad():
    prefix_keep = real[:, None, :] & real[:, :, None] | torch.eye(IMG + LANG, dtype=torch.bool)  # (pads see themselves)
    _, cache = run(torch.cat([img, lang], 1), torch.cumsum(real, 1) - 1, prefix_keep)
    chunk_keep = torch.cat([real[:, None, :].expand(B, CHUNK, -1), torch.ones(B, CHUNK, CHUNK, dtype=torch.bool)], 2)
    noise = torch.randn(B, CHUNK, D)
    x_t, diff = noise.clone(), 0.0
    for step in range(STEPS):
        t = torch.full((B, 1, 1), 1.0 - step / STEPS)
        v_t, _ = run(x_t + time_mlp(t), real.sum(1, keepdim=True) + torch.arange(CHUNK), chunk_keep, past=cache)
        for b, n in enumerate(lengths):  # reference: this sample alone, its pads dropped, prefix and chunk in one pass
            x = torch.cat([img[b], lang[b, :n], (x_t + time_mlp(t))[b]])[None]
            m = IMG + n
            keep = torch.ones(1, m + CHUNK, m + CHUNK, dtype=torch.bool)
            keep[:, :m, m:] = False  # (the prefix never sees the chunk)
            full, _ = run(x, torch.arange(m + CHUNK)[None], keep)
            diff = max(diff, (full[0, m:] - v_t[b]).abs().max().item())
        x_t = x_t - v_t / STEPS
print("max diff cached padded prefix + chunk vs each sample alone:", diff)
assert diff < 1e-10
