"""Patches that cross-attend their own bytes, checked patch by patch against references (quiet).

BLT-style (facebookresearch/blt): a causal byte encoder (SDPA at a line of this file, no module), then a
cross-attention from each patch's query to the bytes of that patch alone (a CrossAttention module handed `kv`). The
self-check runs each reference alone: the byte encoder per row over all its bytes, and the cross-attention per patch
over just that patch's bytes, so the cross-attention module is called with fewer keys than the batch's bytes while
the encoder's reference sees every byte. No memory was cut: the references are other runs. This file's own name
holds "cross_attention", which names no module.
"""
import torch
import torch.nn.functional as F

torch.manual_seed(0)
D, N = 8, 10
lengths = [[3, 4, 3], [5, 2, 3]]
wq, wk, wv = (torch.nn.Linear(D, D) for _ in range(3))


class CrossAttention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = (torch.nn.Linear(D, D) for _ in range(3))

    def forward(self, x, kv, mask=None):
        return F.scaled_dot_product_attention(self.q(x)[:, None], self.k(kv)[:, None], self.v(kv)[:, None],
                                              attn_mask=mask)[:, 0]


cross = CrossAttention()


def encode(h):
    return h + F.scaled_dot_product_attention(wq(h)[:, None], wk(h)[:, None], wv(h)[:, None], is_causal=True)[:, 0]


with torch.no_grad():
    x = torch.randn(2, N, D)
    h = encode(x)
    ids = torch.tensor([[p for p, n in enumerate(row) for _ in range(n)] for row in lengths])  # (B, N) patch of each byte
    queries = torch.randn(2, 3, D)
    mask = ids[:, None, :] == torch.arange(3)[None, :, None]  # (B, patches, bytes)
    out = cross(queries, h, mask[:, None])
    for b, row in enumerate(lengths):
        assert torch.allclose(encode(x[b:b + 1])[0], h[b], atol=1e-5)  # (the encoder's reference: the row alone)
        start = 0
        for p, n in enumerate(row):
            ref = cross(queries[b:b + 1, p:p + 1], h[b:b + 1, start:start + n])
            assert torch.allclose(out[b, p], ref[0, 0], atol=1e-5), (b, p)
            start += n
print("every patch matches its bytes alone")
