"""torchtune PackedDataset + padded_collate_packed: several samples packed into one row, the tail of the
pack filled with padding that torchtune records as one more "sequence" in seq_lens.

Follows pytorch/torchtune torchtune/datasets/_packed.py (PackedDataset._pad_pack: padding tokens get
labels CROSS_ENTROPY_IGNORE_IDX, input_pos continues counting, and `seq_lens` gains an entry for the
padding) and torchtune/modules/attention_utils.py (`packed_block_causal_mask(seq_lens)` =
block_diag of per-sample torch.tril, used by the SDPA path).  Position ids (`input_pos`) restart at 0
for every sample.

Mask meant: block-diagonal causal, one block per sample and one for the padding tail; the padding
rows attend only to padding, their outputs are dropped by ignore_index in the loss.
"""
from typing import List

import torch
import torch.nn as nn
import torch.nn.functional as F

CROSS_ENTROPY_IGNORE_IDX = -100
PAD_ID = 0


def pack_samples(samples: List[List[int]], max_seq_len: int):
    """PackedDataset._pack + _pad_pack for one pack."""
    tokens, labels, input_pos, seq_lens = [], [], [], []
    for s in samples:
        tokens += s
        labels += s[1:] + [CROSS_ENTROPY_IGNORE_IDX]
        input_pos += list(range(len(s)))
        seq_lens.append(len(s))
    num_padding_tokens = max_seq_len - len(tokens)
    if num_padding_tokens > 0:
        tokens += [PAD_ID] * num_padding_tokens
        labels += [CROSS_ENTROPY_IGNORE_IDX] * num_padding_tokens
        # torchtune keeps counting positions through the padding
        start = input_pos[-1] + 1
        input_pos += list(range(start, start + num_padding_tokens))
        seq_lens.append(num_padding_tokens)
    return {
        "tokens": torch.tensor(tokens),
        "labels": torch.tensor(labels),
        "input_pos": torch.tensor(input_pos),
        "seq_lens": torch.tensor(seq_lens),
    }


def create_block_causal_mask(seq_lens: torch.Tensor) -> torch.Tensor:
    batch_block_attn_masks = []
    for sample_idx in range(len(seq_lens)):
        block_attn_masks = [
            torch.tril(torch.ones(seq_len, seq_len, dtype=torch.bool))
            for seq_len in seq_lens[sample_idx]
        ]
        batch_block_attn_masks.append(torch.block_diag(*block_attn_masks))
    return torch.stack(batch_block_attn_masks)


def padded_collate_packed(batch):
    return {
        "tokens": torch.stack([x["tokens"] for x in batch]),
        "labels": torch.stack([x["labels"] for x in batch]),
        "input_pos": torch.stack([x["input_pos"] for x in batch]),
        "mask": create_block_causal_mask([x["seq_lens"] for x in batch]),
    }


class MultiHeadAttention(nn.Module):
    def __init__(self, embed_dim, num_heads, max_seq_len):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, embed_dim // num_heads
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=False)
        self.k_proj = nn.Linear(embed_dim, embed_dim, bias=False)
        self.v_proj = nn.Linear(embed_dim, embed_dim, bias=False)
        self.output_proj = nn.Linear(embed_dim, embed_dim, bias=False)
        self.pos_embeddings = nn.Embedding(max_seq_len, self.head_dim)

    def forward(self, x, *, mask=None, input_pos=None):
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(b, s, self.num_heads, self.head_dim)
        v = self.v_proj(x).view(b, s, self.num_heads, self.head_dim)
        pe = self.pos_embeddings(input_pos)[:, :, None]
        q, k = q + pe, k + pe
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        # torchtune's _sdpa_or_flex_attention: a bool mask of shape [b, s, s] gets a head dim
        mask = mask[:, None, :, :]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=False)
        return self.output_proj(out.transpose(1, 2).reshape(b, s, -1))


class TransformerDecoder(nn.Module):
    def __init__(self, vocab_size=64, embed_dim=32, num_heads=4, num_layers=2, max_seq_len=24):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab_size, embed_dim)
        self.layers = nn.ModuleList(MultiHeadAttention(embed_dim, num_heads, max_seq_len) for _ in range(num_layers))
        self.norm = nn.LayerNorm(embed_dim)
        self.output = nn.Linear(embed_dim, vocab_size, bias=False)

    def forward(self, tokens, *, mask=None, input_pos=None):
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = h + layer(h, mask=mask, input_pos=input_pos)
        return self.output(self.norm(h))


if __name__ == "__main__":
    torch.manual_seed(0)
    max_seq_len = 24
    packs = [
        pack_samples([[5, 9, 3, 7, 2], [11, 4, 6], [8, 8, 1, 3, 12, 7, 2]], max_seq_len),
        pack_samples([[3, 14, 15, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6, 4, 3, 3]], max_seq_len),
    ]
    batch = padded_collate_packed(packs)
    model = TransformerDecoder(max_seq_len=max_seq_len).eval()
    with torch.no_grad():
        logits = model(batch["tokens"], mask=batch["mask"], input_pos=batch["input_pos"])
        loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=CROSS_ENTROPY_IGNORE_IDX)
        # sample 2 of pack 0 (positions 8..14) must match running it alone
        alone = model(batch["tokens"][:1, 8:15], mask=torch.tril(torch.ones(1, 7, 7, dtype=torch.bool)),
                      input_pos=torch.arange(7)[None])
    assert torch.allclose(logits[0, 8:15], alone[0], atol=1e-5)
    print(f"packed loss {loss.item():.4f}")
