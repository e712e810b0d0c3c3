"""Recurrent Memory Transformer segments, following lucidrains/recurrent-memory-transformer-pytorch.

recurrent_memory_transformer_pytorch/recurrent_memory_transformer.py (RecurrentMemoryTransformer.forward with
use_custom_causal_attn_mask=True, and the Wrapper that splits a long sequence into segments). Each segment is packed
as [read memories (R) ; tokens (n) ; write memories (M)]. The mask (two F.pad calls on a tril) says: read memories
see only read memories; tokens see every read memory plus earlier tokens (causal); write memories see everything,
including later tokens and each other. The first segment has no read memories (R = 0). The write memories'
outputs become the next segment's read memories, so information flows forward one segment at a time.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

NUM_MEMORY_TOKENS = 4
SEQ_LEN = 6


class Attention(nn.Module):
    def __init__(self, dim, heads=2):
        super().__init__()
        self.heads = heads
        self.norm = nn.LayerNorm(dim)
        self.to_qkv = nn.Linear(dim, dim * 3, bias=False)
        self.to_out = nn.Linear(dim, dim, bias=False)

    def forward(self, x, mask):
        b, n, d = x.shape
        q, k, v = self.to_qkv(self.norm(x)).chunk(3, dim=-1)
        q, k, v = (t.view(b, n, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.to_out(out.transpose(1, 2).reshape(b, n, d))


class RecurrentMemoryTransformer(nn.Module):
    def __init__(self, num_tokens=50, dim=32, depth=2, num_memory_tokens=NUM_MEMORY_TOKENS, seq_len=SEQ_LEN):
        super().__init__()
        self.num_memory_tokens, self.seq_len = num_memory_tokens, seq_len
        self.token_emb = nn.Embedding(num_tokens, dim)
        self.pos_emb = nn.Embedding(seq_len, dim)
        self.memory_tokens = nn.Parameter(torch.randn(num_memory_tokens, dim) * 0.02)
        self.read_memory_emb = nn.Parameter(torch.zeros(num_memory_tokens, dim))
        self.layers = nn.ModuleList(
            nn.ModuleList([Attention(dim), nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, dim * 2), nn.GELU(),
                                                           nn.Linear(dim * 2, dim))]) for _ in range(depth))
        self.to_logits = nn.Linear(dim, num_tokens)
        self.last_mask = None

    def forward(self, x, read_memories=None):
        b, n = x.shape
        mem_length = self.num_memory_tokens
        x = self.token_emb(x) + self.pos_emb(torch.arange(n))
        write_memories = self.memory_tokens.expand(b, -1, -1)
        if read_memories is not None:
            read_mem_length = mem_length
            read_memories = read_memories + self.read_memory_emb
        else:
            read_mem_length = 0
            read_memories = x[:, 0:0]
        x = torch.cat([read_memories, x, write_memories], dim=1)
        causal_mask = torch.ones((n, n), dtype=torch.bool).tril()
        causal_mask = F.pad(causal_mask, (0, mem_length, read_mem_length, 0), value=False)
        causal_mask = F.pad(causal_mask, (read_mem_length, 0, 0, mem_length), value=True)
        mask = causal_mask[None, None]
        self.last_mask = causal_mask
        for attn, ff in self.layers:
            x = x + attn(x, mask)
            x = x + ff(x)
        read_out, x, write_memories = x.split([read_mem_length, n, mem_length], dim=1)
        return self.to_logits(x), write_memories


def expected_mask(R, n, M):
    """Double loop over packed positions: what the RMT paper's decoder variant allows."""
    T = R + n + M
    m = torch.zeros(T, T, dtype=torch.bool)
    for i in range(T):
        for j in range(T):
            i_read, i_tok, j_read, j_tok = i < R, R <= i < R + n, j < R, R <= j < R + n
            if i_read:
                m[i, j] = j_read
            elif i_tok:
                m[i, j] = j_read or (j_tok and j <= i)
            else:
                m[i, j] = True
    return m


def main():
    torch.manual_seed(0)
    model = RecurrentMemoryTransformer()
    seq = torch.randint(0, 50, (2, 2 * SEQ_LEN + 3))
    x, labels = seq[:, :-1], seq[:, 1:]
    memories, losses = None, []
    for segment, label in zip(x.split(SEQ_LEN, dim=-1), labels.split(SEQ_LEN, dim=-1)):
        logits, memories = model(segment, memories)
        R = 0 if len(losses) == 0 else NUM_MEMORY_TOKENS
        assert torch.equal(model.last_mask, expected_mask(R, segment.size(1), NUM_MEMORY_TOKENS))
        losses.append(F.cross_entropy(logits.transpose(1, 2), label) * segment.size(1) / x.size(1))
    loss = sum(losses)
    loss.backward()
    print(f"segments {len(losses)} loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
