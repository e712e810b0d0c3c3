"""Label-query cross-attention over token embeddings with an inverted SDPA padding mask.

Citation: InseeFrLab/torchTextClassifiers#92 ("fix: correct LabelAttention mask"), commit
9a8b215 ("fix: invert attention mask in LabelAttention to correctly ignore padding tokens").
Upstream: `LabelAttention.forward` in torchTextClassifiers/model/components/text_embedder.py.

Bug: the (B, T) tokenizer mask (1 = real token, 0 = padding) was turned into
`attn_mask = attention_mask == 0` and passed to F.scaled_dot_product_attention, whose boolean
attn_mask means True = *attend*. The label queries therefore attended only to the padding
positions (and, for an unpadded row, to nothing: an all-False row). The code's comments state
the other convention ("True means mask out").

Fix: `attn_mask = attention_mask == 1`.

Reproduction: the module is written as upstream (LabelAttentionConfig dataclass, label
embeddings as queries, QK rms-norm, SDPA); token embeddings come from a small embedding table
over a right-padded batch of token ids with its attention mask. Run with --fixed for the fix.
"""
import sys
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
from torch.nn import functional as F

FIXED = "--fixed" in sys.argv


def norm(x):
    return F.rms_norm(x, (x.size(-1),))


@dataclass
class LabelAttentionConfig:
    n_head: int
    num_classes: int
    embedding_dim: int


class LabelAttention(nn.Module):
    """Labels are queries that attend over token embeddings (keys and values) to produce label-specific embeddings."""

    def __init__(self, label_attention_config: LabelAttentionConfig):
        super().__init__()
        self.label_attention_config = label_attention_config
        self.num_classes = label_attention_config.num_classes
        self.n_head = label_attention_config.n_head
        self.embedding_dim = label_attention_config.embedding_dim
        self.head_dim = self.embedding_dim // self.n_head

        self.label_embeds = nn.Embedding(self.num_classes, self.embedding_dim)
        self.c_q = nn.Linear(self.embedding_dim, self.n_head * self.head_dim, bias=False)
        self.c_k = nn.Linear(self.embedding_dim, self.n_head * self.head_dim, bias=False)
        self.c_v = nn.Linear(self.embedding_dim, self.n_head * self.head_dim, bias=False)
        self.c_proj = nn.Linear(self.embedding_dim, self.embedding_dim, bias=False)

    def forward(self, token_embeddings, attention_mask: Optional[torch.Tensor] = None):
        B, T, C = token_embeddings.size()
        label_indices = torch.arange(self.num_classes, dtype=torch.long).expand(B, -1)
        all_label_embeddings = norm(self.label_embeds(label_indices))  # [batch, num_classes, d_model]

        q = self.c_q(all_label_embeddings).view(B, self.num_classes, self.n_head, self.head_dim)
        k = self.c_k(token_embeddings).view(B, T, self.n_head, self.head_dim)
        v = self.c_v(token_embeddings).view(B, T, self.n_head, self.head_dim)
        q, k = norm(q), norm(k)  # QK norm
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

        # Prepare attention mask for scaled_dot_product_attention
        # attention_mask: (B, T) with 1 for real tokens, 0 for padding
        # scaled_dot_product_attention expects attn_mask: (B, H, Q, K) or broadcastable shape
        # where True means "mask out" (ignore), False means "attend to"
        attn_mask = None
        if attention_mask is not None:
            # Convert: 0 (padding) -> True (mask out), 1 (real) -> False (attend to)
            if FIXED:
                attn_mask = attention_mask == 1  # (B, T)
            else:
                attn_mask = attention_mask == 0  # (B, T)
            # Expand to (B, 1, 1, T) for broadcasting across heads and queries
            attn_mask = attn_mask.unsqueeze(1).unsqueeze(2)  # (B, 1, 1, T)

        y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=False)
        y = y.transpose(1, 2).contiguous().view(B, self.num_classes, -1)  # (bs, n_labels, d_model)
        return {"sentence_embedding": self.c_proj(y), "attention_matrix": None}


def main():
    torch.manual_seed(0)
    padding_idx = 0
    token_embedder = nn.Embedding(50, 32, padding_idx=padding_idx)
    label_attention = LabelAttention(LabelAttentionConfig(n_head=4, num_classes=5, embedding_dim=32)).eval()
    input_ids = torch.tensor([[12, 7, 33, 41, 9, 0, 0, 0],
                              [5, 18, 22, 0, 0, 0, 0, 0]])
    attention_mask = (input_ids != padding_idx).long()
    with torch.no_grad():
        out = label_attention(token_embedder(input_ids), attention_mask=attention_mask)
    logits = out["sentence_embedding"].sum(-1)
    print("per-label scores, row 0:", [round(x, 4) for x in logits[0].tolist()])


if __name__ == "__main__":
    main()
