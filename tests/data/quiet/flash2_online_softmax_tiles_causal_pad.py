# A FlashAttention-2 forward written in plain torch, as the Triton tutorial's and flash-attn's reference loops lay it
# out, another way than memory-efficient-attention-pytorch's summed chunks: the queries and keys split with
# torch.split into tiles of different sizes, each tile's causal mask rebuilt from the tiles' offsets and joined with a
# key padding mask given the other way round (True = pad), one online softmax per query tile (running max m_i, running
# sum l_i, the accumulator rescaled), every key tile visited. Checked against each sequence alone, unpadded, in one
# dense causal softmax.
import torch

torch.manual_seed(4)
torch.set_default_dtype(torch.float64)
B, H, T, D, BQ, BK = 2, 2, 26, 8, 6, 5
q, k, v = (torch.randn(B, H, T, D) for _ in range(3))
lengths = [26, 15]
pad = torch.arange(T)[None] >= torch.tensor(lengths)[:, None]  # True = padding key


def flash_forward(q, k, v, pad):
    out = []
    for qs, q_tile in zip(range(0, T, BQ), q.split(BQ, dim=2)):
        rows = qs + torch.arange(q_tile.shape[2])
        m_i = torch.full(q_tile.shape[:3] + (1,), float("-inf"))
        l_i = torch.zeros_like(m_i)
        acc = torch.zeros_like(q_tile)
        for ks, (k_tile, v_tile) in zip(range(0, T, BK), zip(k.split(BK, dim=2), v.split(BK, dim=2))):
            cols = ks + torch.arange(k_tile.shape[2])
            hidden = (cols[None, :] > rows[:, None])[None, None] | pad[:, None, None, ks:ks + k_tile.shape[2]]
            s = (q_tile @ k_tile.transpose(-1, -2)) * D ** -0.5
            s = s.masked_fill(hidden, -1e30)
            m_new = torch.maximum(m_i, s.amax(-1, keepdim=True))
            p = torch.exp(s - m_new) * ~hidden
            alpha = torch.exp(m_i - m_new)
            l_i = l_i * alpha + p.sum(-1, keepdim=True)
            acc = acc * alpha + p @ v_tile
            m_i = m_new
        out.append(acc / l_i.clamp(min=1e-300))
    return torch.cat(out, 2)


out = flash_forward(q, k, v, pad)
diff = 0.0
for b, n in enumerate(lengths):
    s = q[b, :, :n] @ k[b, :, :n].transpose(-1, -2) * D ** -0.5
    s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    diff = max(diff, (s.softmax(-1) @ v[b, :, :n] - out[b, :, :n]).abs().max().item())
print("max diff tiled online softmax vs each sequence alone:", diff)
assert diff < 1e-12
