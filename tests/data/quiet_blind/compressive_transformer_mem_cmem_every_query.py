"""Compressive Transformer self-attention over [compressed memory ; memory ; segment], after lucidrains.

Follows lucidrains/compressive-transformer-pytorch compressive_transformer_pytorch/compressive_transformer_pytorch.py
(SelfAttention.forward, ConvCompress). Keys are cat(cmem, mem, x); the causal mask is
`ones(t, t + total_mem_len).triu_(diagonal=1 + total_mem_len)`: every query sees every memory and compressed-memory
slot (all of them lie in the past) and the segment's tokens up to itself. Stated lengths: seq_len 4, mem_len 4,
cmem_len 2, cmem_ratio 2. After each segment the oldest memories are squeezed by a strided Conv1d into cmem. The
first segment has empty memories (0 memory keys). Attention dropout is applied to the weights (eval here).
"""
from collections import namedtuple

import torch
import torch.nn as nn
import torch.nn.functional as F

Memory = namedtuple("Memory", ["mem", "compressed_mem"])
SEQ_LEN, MEM_LEN, CMEM_LEN, CMEM_RATIO = 4, 4, 2, 2


class ConvCompress(nn.Module):
    def __init__(self, dim, ratio=4):
        super().__init__()
        self.conv = nn.Conv1d(dim, dim, ratio, stride=ratio)

    def forward(self, mem):
        return self.conv(mem.transpose(1, 2)).transpose(1, 2)


class SelfAttention(nn.Module):
    def __init__(self, dim, seq_len, mem_len, cmem_len, cmem_ratio=4, heads=4, attn_dropout=0.1):
        super().__init__()
        self.heads, self.dim_head = heads, dim // heads
        self.seq_len, self.mem_len, self.cmem_len = seq_len, mem_len, cmem_len
        self.scale = self.dim_head ** -0.5
        self.compress_mem_fn = ConvCompress(dim, cmem_ratio)
        self.to_q = nn.Linear(dim, dim, bias=False)
        self.to_kv = nn.Linear(dim, dim * 2, bias=False)
        self.to_out = nn.Linear(dim, dim)
        self.attn_dropout = nn.Dropout(attn_dropout)

    def forward(self, x, memories=None):
        b, t, e = x.shape
        mem, cmem = memories if memories is not None else (None, None)
        mem = mem if mem is not None else x.new_empty(b, 0, e)
        cmem = cmem if cmem is not None else x.new_empty(b, 0, e)
        mem_len, cmem_len = mem.shape[1], cmem.shape[1]
        q = self.to_q(x)
        kv_input = torch.cat((cmem, mem, x), dim=1)
        k, v = self.to_kv(kv_input).chunk(2, dim=-1)
        merge_heads = lambda z: z.reshape(b, -1, self.heads, self.dim_head).transpose(1, 2)
        q, k, v = map(merge_heads, (q, k, v))
        dots = torch.einsum("bhid,bhjd->bhij", q, k) * self.scale
        mask_value = -torch.finfo(dots.dtype).max
        total_mem_len = mem_len + cmem_len
        mask = torch.ones(t, t + total_mem_len).triu_(diagonal=1 + total_mem_len).bool()
        dots.masked_fill_(mask[None, None, ...], mask_value)
        attn = dots.softmax(dim=-1)
        attn = self.attn_dropout(attn)
        out = torch.einsum("bhij,bhjd->bhid", attn, v).transpose(1, 2).reshape(b, t, -1)
        logits = self.to_out(out)
        # memory update: newest mem_len positions stay, older ones are compressed
        both = torch.cat((mem, x), dim=1)
        old_mem, new_mem = both[:, : -self.mem_len], both[:, -self.mem_len :]
        new_cmem = cmem
        if old_mem.shape[1] > 0:
            compressed_mem = self.compress_mem_fn(old_mem)
            new_cmem = torch.cat((cmem, compressed_mem), dim=1)[:, -self.cmem_len :]
        return logits, Memory(new_mem.detach(), new_cmem.detach()), (cmem_len, mem_len)


def reference(layer, x, memories):
    """Same attention through SDPA with a mask from a double loop over absolute positions."""
    mem, cmem = memories if memories is not None else (x[:, :0], x[:, :0])
    kv = torch.cat((cmem, mem, x), dim=1)
    M, t = cmem.shape[1] + mem.shape[1], x.shape[1]
    allowed = torch.zeros(t, M + t, dtype=torch.bool)
    for i in range(t):
        for j in range(M + t):
            allowed[i, j] = j < M or (j - M) <= i  # memory lies before the segment
    b = x.shape[0]
    q = layer.to_q(x).view(b, t, layer.heads, -1).transpose(1, 2)
    k, v = (z.view(b, M + t, layer.heads, -1).transpose(1, 2) for z in layer.to_kv(kv).chunk(2, dim=-1))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
    return layer.to_out(out.transpose(1, 2).reshape(b, t, -1))


def main():
    torch.manual_seed(0)
    dim = 16
    emb = nn.Embedding(20, dim)
    layer = SelfAttention(dim, SEQ_LEN, MEM_LEN, CMEM_LEN, CMEM_RATIO).eval()
    seq = torch.randint(0, 20, (2, SEQ_LEN * 4))
    memories, seen = None, []
    with torch.no_grad():
        for segment in seq.split(SEQ_LEN, dim=1):
            x = emb(segment)
            out, next_memories, lens = layer(x, memories)
            assert torch.allclose(out, reference(layer, x, memories), atol=1e-5)
            seen.append(lens)
            memories = next_memories
    assert seen == [(0, 0), (0, 4), (2, 4), (2, 4)], seen
    print(f"segments {len(seen)} memory lengths {seen}")


if __name__ == "__main__":
    main()
