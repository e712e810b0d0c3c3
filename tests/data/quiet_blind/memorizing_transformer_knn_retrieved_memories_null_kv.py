"""Memorizing Transformer: kNN-retrieved (key, value) memories per query, padded list masked, null kv always on.

Follows lucidrains/memorizing-transformers-pytorch memorizing_transformers_pytorch/memorizing_transformers_pytorch.py
@016881f5a7a356d3881f7d01a62740f8e35fde8c (Attention, KNNAttention, MemorizingTransformer.forward) with the faiss
KNNMemory of knn_memory.py replaced by an exact in-RAM torch search that returns the same (mem_kv, mem_mask) shapes.
Two attentions in the memorizing layer, gated per head:
- local: causal over the current segment (triu(j - i + 1) filled with -finfo.max);
- memory: each query attends to ITS OWN list of `num_retrieved_memories` neighbours gathered from the memory of
  earlier segments of the same batch row, plus a learned null key/value always visible. When the memory holds
  fewer entries than asked (first segments), the list is padded with zero rows and mem_mask hides them; at the
  first segment only the null kv is visible. Memories are keys/values of PAST segments, so no causal mask applies
  to them. Documents differ per batch row: row b searches only memory index b.
"""
import math

import torch
import torch.nn.functional as F
from torch import nn, einsum


def l2norm(t):
    return F.normalize(t, dim=-1)


def stable_softmax(t, dim=-1):
    t = t - t.amax(dim=dim, keepdim=True).detach()
    return F.softmax(t, dim=dim)


class KNNMemory:
    """Exact inner-product search over stored (key, value) pairs, one store per batch index."""

    def __init__(self, dim, max_memories, num_indices):
        self.dim = dim
        self.max_memories = max_memories
        self.num_indices = num_indices
        self.db = torch.zeros(num_indices, max_memories, 2, dim)
        self.db_offsets = torch.zeros(num_indices, dtype=torch.long)

    def add(self, memories):
        # memories: [b, n, 2, d]
        n = memories.shape[1]
        for b in range(self.num_indices):
            start = int(self.db_offsets[b])
            self.db[b, start:start + n] = memories[b]
        self.db_offsets += n

    def search(self, queries, topk):
        # queries: [b, m, d] -> mem_kv [b, m, topk, 2, d], mem_mask [b, m, topk]
        b, m, d = queries.shape
        mem_kv = torch.zeros(b, m, topk, 2, d)
        mem_mask = torch.zeros(b, m, topk, dtype=torch.bool)
        for i in range(b):
            count = int(self.db_offsets[i])
            if count == 0:
                continue
            keys = self.db[i, :count, 0]
            k = min(topk, count)
            idx = (queries[i] @ keys.T).topk(k, dim=-1).indices  # [m, k]
            mem_kv[i, :, :k] = self.db[i, :count][idx]
            mem_mask[i, :, :k] = True
        return mem_kv, mem_mask


class KNNAttention(nn.Module):
    def __init__(self, *, dim, heads=4, dim_head=8, num_retrieved_memories=6):
        super().__init__()
        self.heads = heads
        self.scale = dim_head ** -0.5
        inner_dim = heads * dim_head
        self.num_retrieved_memories = num_retrieved_memories
        self.combine_attn_output_gate = nn.Parameter(torch.randn(heads, 1, 1))
        self.null_k = nn.Parameter(torch.randn(dim_head))
        self.null_v = nn.Parameter(torch.randn(dim_head))
        self.to_q = nn.Linear(dim, inner_dim, bias=False)
        self.to_kv = nn.Linear(dim, dim_head * 2, bias=False)
        self.to_out = nn.Linear(inner_dim, dim)

    def forward(self, x, *, knn_memory, add_memory=True):
        b, n, h = x.shape[0], x.shape[1], self.heads
        q, k, v = (self.to_q(x), *self.to_kv(x).chunk(2, dim=-1))
        q = q.view(b, n, h, -1).transpose(1, 2)

        sim = einsum('b h i d, b j d -> b h i j', q, k) * self.scale
        i, j = sim.shape[-2:]
        mask_value = -torch.finfo(sim.dtype).max
        causal_mask = torch.ones((i, j), dtype=torch.bool).triu(j - i + 1)
        sim = sim.masked_fill(causal_mask, mask_value)
        attn = stable_softmax(sim)
        local_values = einsum('b h i j, b j d -> b h i d', attn, v)

        knn_queries = q.reshape(b, h * n, -1)
        mem_kv, mem_mask = knn_memory.search(knn_queries, self.num_retrieved_memories)
        mem_mask = mem_mask.view(b, h, n, -1)
        mem_k, mem_v = mem_kv.view(b, h, n, self.num_retrieved_memories, 2, -1).unbind(dim=-2)
        # use null key / value to protect against empty memory
        null_k = self.null_k.expand(b, h, n, 1, -1)
        null_v = self.null_v.expand(b, h, n, 1, -1)
        mem_k = torch.cat((null_k, mem_k), dim=-2)
        mem_v = torch.cat((null_v, mem_v), dim=-2)
        mem_mask = F.pad(mem_mask, (1, 0), value=True)
        sim_mem = einsum('b h i d, b h i j d -> b h i j', q, mem_k) * self.scale
        sim_mem = sim_mem.masked_fill(~mem_mask, mask_value)
        attn_mem = stable_softmax(sim_mem)
        mem_values = einsum('b h i j, b h i j d -> b h i d', attn_mem, mem_v)

        gate = self.combine_attn_output_gate.sigmoid()
        out = local_values * gate + mem_values * (1 - gate)
        if add_memory:
            kv = torch.stack((k, v), dim=-2)
            knn_memory.add(l2norm(kv))
        out = out.transpose(1, 2).reshape(b, n, -1)
        self.last = (q, k, v, mem_k, mem_v, mem_mask, out)
        return self.to_out(out)


def _reference(q, k, v, mem_k, mem_v, mem_mask, gate, scale):
    """Per (batch, head, query) loops over absolute positions and the valid retrieved list."""
    b, h, n, d = q.shape
    out = torch.zeros(b, h, n, d)
    for bi in range(b):
        for hi in range(h):
            for i in range(n):
                local = torch.softmax((k[bi, :i + 1] @ q[bi, hi, i]) * scale, dim=0) @ v[bi, :i + 1]
                keep = mem_mask[bi, hi, i]
                mem = torch.softmax((mem_k[bi, hi, i, keep] @ q[bi, hi, i]) * scale, dim=0) @ mem_v[bi, hi, i, keep]
                out[bi, hi, i] = local * gate[hi, 0, 0] + mem * (1 - gate[hi, 0, 0])
    return out


def main():
    torch.manual_seed(0)
    dim, batch, seg_len = 32, 2, 4
    attn = KNNAttention(dim=dim).eval()
    memory = KNNMemory(dim=8, max_memories=64, num_indices=batch)
    segments = torch.randn(3, batch, seg_len, dim)
    visible = []
    with torch.no_grad():
        for seg in segments:
            attn(seg, knn_memory=memory)
            q, k, v, mem_k, mem_v, mem_mask, out = attn.last
            gate = attn.combine_attn_output_gate.sigmoid()
            ref = _reference(q, k, v, mem_k, mem_v, mem_mask, gate, attn.scale)
            assert torch.allclose(out, ref.transpose(1, 2).reshape(batch, seg_len, -1), atol=1e-5)
            visible.append(int(mem_mask[0, 0, 0].sum()))
    assert visible == [1, 5, 7]  # null only; null + 4 of 6 (2 padded); null + 6
    print("memorizing transformer knn attention ok, visible memories per segment:", visible)


if __name__ == "__main__":
    main()
