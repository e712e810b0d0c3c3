# The same bug as axonn-ai/yalis#53, written another way: a packed-sequence trainer builds one FlexAttention
# document mask for the whole batch with `create_block_mask(doc_causal, None, None, L, L)`. Its mask_mod reads each
# row's own document ids (`docs[b, q] == docs[b, kv]`), but with B=None the block lists are row 0's: row 0 packs two
# documents of 128 tokens, row 1 one document of 256, so row 1's second half never visits the first key block its own
# mask_mod keeps (a fused kernel drops those keys). An evaluation pass (FlexAttention has no CPU backward).
# Fixed: B=batch size.
import sys
import warnings

import torch
import torch.nn as nn
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

warnings.filterwarnings("ignore")
FIXED = "--fixed" in sys.argv


class Block(nn.Module):
    def __init__(self, d=32, heads=2):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d, bias=False)

    def forward(self, x, block_mask):
        B, L, D = x.shape
        q, k, v = self.qkv(x).view(B, L, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        y = flex_attention(q, k, v, block_mask=block_mask)
        return x + self.proj(y.transpose(1, 2).reshape(B, L, D))


class PackedLM(nn.Module):
    def __init__(self, vocab=64, d=32, n_layers=2):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList([Block(d) for _ in range(n_layers)])
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, input_ids, document_ids):
        B, L = input_ids.shape

        def doc_causal(b, h, q_idx, kv_idx):
            return (document_ids[b, q_idx] == document_ids[b, kv_idx]) & (kv_idx <= q_idx)

        block_mask = create_block_mask(doc_causal, B if FIXED else None, None, L, L, device="cpu")
        x = self.emb(input_ids)
        for block in self.blocks:
            x = block(x, block_mask)
        return self.head(x)


def main():
    torch.manual_seed(0)
    L = 256
    input_ids = torch.randint(0, 64, (2, L))
    document_ids = torch.stack([torch.arange(L) // 128, torch.zeros(L, dtype=torch.long)])  # row 0: 2 docs, row 1: 1
    model = PackedLM().eval()
    with torch.no_grad():
        logits = model(input_ids, document_ids)
    loss = nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 64), input_ids[:, 1:].reshape(-1))
    print(f"eval loss={loss.item():.4f}")


if __name__ == "__main__":
    main()
