# The SpecForge#427 bug (a block drafter trained with a causal-looking mask inside each block, drafted with the block
# seeing itself both ways) written as a semi-autoregressive block diffusion LM (BD3-LM / SDAR style, plain functions):
# training attends every noisy block at once over [clean tokens | noisy tokens] with a boolean mask, batch row 1
# right-padded inside its last block; sampling denoises one block at a time over the clean prefix, the block
# bidirectional. The buggy training mask keeps the noisy block lower-triangular (q >= k); the fix keeps it whole.
import sys
import torch

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
D, V, BLOCK, L = 16, 30, 4, 16
MASK_ID = V - 1
emb = torch.randn(V, D)
wq, wk, wv = (torch.randn(D, D) / D ** 0.5 for _ in range(3))


def attend(x_noisy, x_clean, keep):
    # manual attention: queries are the noisy tokens, keys/values the clean context followed by the noisy tokens
    q = x_noisy @ wq
    kv = torch.cat([x_clean, x_noisy], dim=1)
    scores = q @ (kv @ wk).transpose(-1, -2) / D ** 0.5
    scores = scores.masked_fill(~keep, float("-inf"))
    return torch.softmax(scores, dim=-1).nan_to_num(0.0) @ (kv @ wv)


def training_mask(lengths):
    idx = torch.arange(L)
    blk = idx // BLOCK
    real = idx[None, :] < lengths[:, None]                                   # (B, L)
    both = real[:, :, None] & real[:, None, :]
    clean_part = both & (blk[None, None, :] < blk[None, :, None])            # earlier blocks' clean tokens
    same = blk[None, :, None] == blk[None, None, :]
    noisy_part = both & same if FIXED else both & same & (idx[None, None, :] <= idx[None, :, None])
    return torch.cat([clean_part, noisy_part], dim=-1)                       # (B, L, 2L)


tokens = torch.randint(0, V - 1, (2, L))
lengths = torch.tensor([L, 14])
noisy = tokens.clone()
noisy[:, 1::2] = MASK_ID                                                     # half of every block masked
out_train = attend(emb[noisy], emb[tokens], training_mask(lengths))

# sampling, row 0: block b denoised alone over the clean prefix, every query seeing the whole block
diffs = []
for b in range(1, L // BLOCK):
    s = b * BLOCK
    keep = torch.ones(1, BLOCK, s + BLOCK, dtype=torch.bool)
    out_step = attend(emb[noisy[:1, s:s + BLOCK]], emb[tokens[:1, :s]], keep)
    diffs.append((out_train[:1, s:s + BLOCK] - out_step).abs().max().item())
print(f"max |block trained in parallel - block sampled alone| = {max(diffs):.6f}")
