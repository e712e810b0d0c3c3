# Follows 1x-technologies/1xgpt genie/st_transformer.py STBlock: spatial attention inside each frame (causal=False,
# "B T S C -> (B T) S C") then temporal attention per spatial position (causal=True, "B T S C -> (B S) T C").
# Here two videos are packed into one flat token sequence, so each sub-layer gets its own mask (bool, True = keep).
import torch
torch.manual_seed(9)
torch.set_default_dtype(torch.float64)
D, S = 32, 4                          # S tokens per frame (2x2 latent grid)
Ws = [torch.randn(D, 3 * D) / D ** 0.5 for _ in range(2)]   # spatial, temporal

def attn(h, W, mask=None, is_causal=False):
    q, k, v = (h @ W).split(D, -1)
    return h + torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal)

def st_block(video):                  # reference path, as in the project: reshape, no explicit masks
    T = video.shape[0]
    h = attn(video, Ws[0])                                      # (T, S, D): frames as the batch
    h = attn(h.transpose(0, 1), Ws[1], is_causal=True)          # (S, T, D): positions as the batch
    return h.transpose(0, 1)

frames = [3, 2]
videos = [torch.randn(t, S, D) for t in frames]
flat = torch.cat([v.reshape(-1, D) for v in videos])           # (20, D) packed
vid = torch.cat([torch.full((t * S,), i) for i, t in enumerate(frames)])
frm = torch.cat([torch.arange(t).repeat_interleave(S) for t in frames])
pos = torch.cat([torch.arange(S).repeat(t) for t in frames])
same_vid = vid[:, None] == vid[None, :]
spatial_mask = same_vid & (frm[:, None] == frm[None, :])                                     # bidirectional in frame
temporal_mask = same_vid & (pos[:, None] == pos[None, :]) & (frm[None, :] <= frm[:, None])   # causal across frames
h = attn(flat, Ws[0], mask=spatial_mask)
h = attn(h, Ws[1], mask=temporal_mask)

ref = torch.cat([st_block(v).reshape(-1, D) for v in videos])
d = (h - ref).abs().max().item()
print("max diff packed flat ST masks vs per-video reshape STBlock:", d)
assert d < 1e-12
