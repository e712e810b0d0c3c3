"""A packed batch of one flattened row, documents of 2, 4 and 2 tokens, handed to the model call as cu_seqlens; each
layer runs a plain-torch stand-in for flash_attn_varlen_func: one causal SDPA call per document over its own tokens.
Correct: a call over 4 keys is the 4-token document alone, not a row of a batch of two rows of 4."""

import torch
import torch.nn.functional as F


def varlen(q, k, v, cu_seqlens):
    out = torch.zeros_like(q)
    for a, b in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()):
        out[a:b] = F.scaled_dot_product_attention(q[a:b].transpose(0, 1), k[a:b].transpose(0, 1),
                                                  v[a:b].transpose(0, 1), is_causal=True).transpose(0, 1)
    return out


class Layer(torch.nn.Module):
    def __init__(self, dim=16, heads=2):
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(dim, 3 * dim)

    def forward(self, x, cu_seqlens):
        t, d = x.shape
        q, k, v = self.qkv(x).view(t, 3, self.heads, d // self.heads).unbind(1)
        return x + varlen(q, k, v, cu_seqlens).reshape(t, d)


class PackedLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(50, 16)
        self.layers = torch.nn.ModuleList(Layer() for _ in range(2))

    def forward(self, input_ids, position_ids, cu_seqlens):
        x = self.embed(input_ids[0])
        for layer in self.layers:
            x = layer(x, cu_seqlens)
        return x


torch.manual_seed(0)
lengths = [2, 4, 2]
ids = torch.randint(1, 50, (1, sum(lengths)))
positions = torch.cat([torch.arange(n) for n in lengths])[None]
cu = F.pad(torch.tensor(lengths).cumsum(0), (1, 0)).to(torch.int32)
with torch.no_grad():
    print("sum:", round(PackedLM().eval()(ids, positions, cu).sum().item(), 4))
