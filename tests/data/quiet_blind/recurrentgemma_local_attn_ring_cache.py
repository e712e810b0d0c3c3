# Follows google-deepmind/recurrentgemma torch/modules.py LocalAttentionBlock (_compute_forward_pass_mask over
# segment_pos, a window-sized ring-buffer cache for decoding) in a Griffin-style hybrid with an RG-LRU-like recurrence.
# Prefill mask: same packed document (segment_pos resets to 0) AND 0 <= q-k < window. Decode: ring slot = pos % window.
import torch
torch.manual_seed(6)
torch.set_default_dtype(torch.float64)
D, WIN = 32, 4
Wq, Wk, Wv, Wx = (torch.randn(D, D) / D ** 0.5 for _ in range(4))
a = torch.rand(D) * 0.9

def recurrence_scan(x, seg_pos):
    h = torch.zeros(x.shape[0], D); out = []
    for t in range(x.shape[1]):
        reset = (seg_pos[:, t] == 0)[:, None]
        h = torch.where(reset, torch.zeros(()), a * h) + (1 - a ** 2).sqrt() * (x[:, t] @ Wx)
        out.append(h)
    return torch.stack(out, 1)

def forward_pass_mask(seg_pos, window):
    seg_ids = torch.cumsum(seg_pos == 0, -1)
    T = seg_pos.shape[1]
    pos = torch.arange(T)
    causal = pos[:, None] >= pos[None, :]
    same = seg_ids[:, :, None] == seg_ids[:, None, :]
    local = (pos[:, None] - pos[None, :]) < window
    return same & causal & local                   # (B, T, T), True = attend

def prefill(x, seg_pos):
    h = x + recurrence_scan(x, seg_pos)
    q, k, v = h @ Wq, h @ Wk, h @ Wv
    m = forward_pass_mask(seg_pos, WIN)
    o = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=m)
    return h + o

# two packed documents per row, different split points per row
T = 14
seg_pos = torch.stack([torch.cat([torch.arange(9), torch.arange(5)]), torch.cat([torch.arange(3), torch.arange(11)])])
x = torch.randn(2, T, D)
out = prefill(x, seg_pos)

# reference: token-by-token decode, one row at a time, ring buffer cache of WIN slots reset at each document start
ref = torch.zeros_like(out)
for b in range(2):
    for t in range(T):
        sp = int(seg_pos[b, t])
        if sp == 0:
            kc, vc = torch.zeros(WIN, D), torch.zeros(WIN, D)
            slot_pos = torch.full((WIN,), -1)
            hstate = torch.zeros(D)
        hstate = a * hstate + (1 - a ** 2).sqrt() * (x[b, t] @ Wx)
        h = x[b, t] + hstate
        slot = sp % WIN
        kc[slot], vc[slot], slot_pos[slot] = h @ Wk, h @ Wv, sp
        valid = (slot_pos >= 0) & (sp - slot_pos < WIN)          # cache mask: written and inside the window
        s = (kc @ (h @ Wq)) / D ** 0.5
        s = s.masked_fill(~valid, float("-inf"))
        ref[b, t] = h + s.softmax(-1) @ vc
d = (out - ref).abs().max().item()
print("max diff packed local-attention prefill vs ring-buffer decode:", d)
assert d < 1e-12
