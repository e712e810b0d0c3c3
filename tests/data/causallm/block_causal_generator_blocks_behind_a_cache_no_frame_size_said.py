"""A block-causal generator (quiet): each step a block of latent tokens attends itself both ways and every earlier
block behind its cache; no config states a frame's size, the class is named CausalSelfAttention.

MemFlow / Self-Forcing style, with nothing that says how many tokens a frame holds: the first pass is block 0
(6 tokens attend each other), and every later step is another block of 6 over the cached blocks and itself. Causal
from block to block, both ways inside a block, and every step as large as the first: no token is decoded alone.
Self-check: each block's output matches one pass over all the blocks so far with a block-causal mask.
"""
import torch
import torch.nn.functional as F

torch.manual_seed(0)
D, H, BLOCK, BLOCKS = 16, 2, 6, 4


class CausalSelfAttention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv, self.out = torch.nn.Linear(D, 3 * D), torch.nn.Linear(D, D)

    def forward(self, x, cache=None, mask=None):
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, H, D // H).permute(2, 0, 3, 1, 4)
        if cache is not None:
            k, v = torch.cat([cache[0], k], 2), torch.cat([cache[1], v], 2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.out(out.transpose(1, 2).reshape(b, n, D)), (k, v)


layer = CausalSelfAttention()
with torch.no_grad():
    latents = torch.randn(1, BLOCK * BLOCKS, D)
    cache, outs = None, []
    for n in range(BLOCKS):
        out, cache = layer(latents[:, n * BLOCK:(n + 1) * BLOCK], cache)  # (a block sees itself and every earlier one)
        outs.append(out)
    ids = torch.arange(BLOCK * BLOCKS) // BLOCK
    whole, _ = layer(latents, mask=ids[None, :] <= ids[:, None])
    assert torch.allclose(torch.cat(outs, 1), whole, atol=1e-5)
print("every block matches one block-causal pass")
