# Follows guandeh17/Self-Forcing wan/modules/causal_model.py CausalWanModel._prepare_blockwise_causal_attn_mask:
# ends[q] = end of q's frame block, mask_mod = (kv_idx < ends[q_idx]) | (q_idx == kv_idx); tokens padded past the
# video see only themselves. Training-time block mask vs block-by-block generation with a per-layer KV cache.
import math, torch
from torch.nn.attention.flex_attention import create_mask
torch.manual_seed(8)
torch.set_default_dtype(torch.float64)
D, LAYERS = 32, 2
frame_seqlen, num_frame_per_block, num_frames = 4, 2, 6
Wqkv = [torch.randn(D, 3 * D) / D ** 0.5 for _ in range(LAYERS)]

total_length = num_frames * frame_seqlen
padded_length = math.ceil(total_length / 16) * 16 - total_length   # 128 in the original; 16 at this size
ends = torch.zeros(total_length + padded_length, dtype=torch.long)
for tmp in range(0, total_length, frame_seqlen * num_frame_per_block):
    ends[tmp:tmp + frame_seqlen * num_frame_per_block] = tmp + frame_seqlen * num_frame_per_block

def attention_mask(b, h, q_idx, kv_idx):
    return (kv_idx < ends[q_idx]) | (q_idx == kv_idx)

L = total_length + padded_length
block_mask = create_mask(attention_mask, None, None, L, L, device="cpu")   # (1,1,L,L) bool, True = attend

def layer(l, h, mask=None, cache=None):
    q, k, v = (h @ Wqkv[l]).split(D, -1)
    if cache is not None:
        k = torch.cat([cache[0], k], -2); v = torch.cat([cache[1], v], -2)
    o = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return h + o, (k, v)

x = torch.randn(1, 1, total_length, D)
h = torch.cat([x, torch.randn(1, 1, padded_length, D)], -2)     # padded tail, sliced off below
for l in range(LAYERS):
    h, _ = layer(l, h, mask=block_mask)
train_out = h[..., :total_length, :]

# inference: one block of frames at a time; the block attends to the whole cache and to itself bidirectionally
blk = frame_seqlen * num_frame_per_block
caches = [(torch.zeros(1, 1, 0, D), torch.zeros(1, 1, 0, D)) for _ in range(LAYERS)]
outs = []
for s in range(0, total_length, blk):
    h = x[..., s:s + blk, :]
    for l in range(LAYERS):
        h, caches[l] = layer(l, h, mask=None, cache=caches[l])
    outs.append(h)
gen_out = torch.cat(outs, -2)
d = (train_out - gen_out).abs().max().item()
print("max diff block-causal training mask vs block-wise KV-cache generation:", d)
assert d < 1e-12
