"""A batched decode over a preallocated KV cache whose buffers start as ones (`torch.ones`, so that an unwritten
slot is easy to spot in a debugger), written slot by slot, handed to SDPA whole: its attention mask is built from the
buffer's size, not from the lengths written, so every query attends the slots nobody wrote yet (K and V all 1.0).
The same bug as vllm#47926's DFlash drafter (an unwritten context-KV buffer attended whole), written the way a
hand-rolled generation loop writes it: a (B, H, S, D) cache, two prompts, a boolean key mask per step.
Fix: the mask keeps key slots [0, cache_len) only.

    python ones_filled_kv_cache_batched_decode_whole_buffer.py [--fixed]
"""
import sys

import torch
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

B, H, D, VOCAB, MAX_SEQ = 2, 2, 8, 32, 16


class KVCache(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("k", torch.ones(B, H, MAX_SEQ, D))
        self.register_buffer("v", torch.ones(B, H, MAX_SEQ, D))
        self.length = 0

    def update(self, k, v):
        n = k.shape[2]
        self.k[:, :, self.length:self.length + n] = k
        self.v[:, :, self.length:self.length + n] = v
        self.length += n
        return self.k, self.v


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, H * D)
        self.qkv = torch.nn.Linear(H * D, 3 * H * D)
        self.out = torch.nn.Linear(H * D, VOCAB)
        self.cache = KVCache()

    def forward(self, ids):
        b, t = ids.shape
        start = self.cache.length
        q, k, v = self.qkv(self.emb(ids)).view(b, t, 3, H, D).permute(2, 0, 3, 1, 4)
        keys, values = self.cache.update(k, v)
        slot = torch.arange(MAX_SEQ)
        pos = torch.arange(start, start + t)
        allowed = slot[None, :] <= pos[:, None]                     # causal over the written slots
        if not FIXED:
            allowed = allowed | (slot[None, :] >= start + t)         # built over the whole buffer
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=allowed[None, None])
        return self.out(out.transpose(1, 2).reshape(b, t, H * D))


@torch.no_grad()
def main():
    model = Block().eval()
    ids = torch.randint(1, VOCAB, (B, 5))
    logits = model(ids)
    for _ in range(3):
        nxt = logits[:, -1].argmax(-1, keepdim=True)
        logits = model(nxt)
    print(f"fixed={FIXED} last tokens={logits[:, -1].argmax(-1).tolist()}")


if __name__ == "__main__":
    main()
