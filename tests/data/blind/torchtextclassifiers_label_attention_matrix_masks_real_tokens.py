# InseeFrLab/torchTextClassifiers#96 (commit fad80a5): LabelAttention's explanation matrix
# (softmax(q @ k.T)) was filled with -inf where attn_mask is True, i.e. on the real tokens,
# so each label "attended" only to padding; the fix fills ~attn_mask instead.
import sys
from typing import Optional

import torch
import torch.nn as nn
from torch.nn import functional as F

FIXED = "--fixed" in sys.argv


def norm(x):
    # Purely functional rmsnorm with no learnable params
    return F.rms_norm(x, (x.size(-1),))


class LabelAttention(nn.Module):
    """Labels are queries that attend over token embeddings (keys and values)."""

    def __init__(self, embedding_dim: int, num_classes: int, n_head: int):
        super().__init__()
        self.embedding_dim = embedding_dim
        self.num_classes = num_classes
        self.n_head = n_head
        self.head_dim = self.embedding_dim // self.n_head
        self.label_embeds = nn.Embedding(self.num_classes, self.embedding_dim)
        self.c_q = nn.Linear(self.embedding_dim, self.n_head * self.head_dim, bias=False)
        self.c_k = nn.Linear(self.embedding_dim, self.n_head * self.head_dim, bias=False)
        self.c_v = nn.Linear(self.embedding_dim, self.n_head * self.head_dim, bias=False)
        self.c_proj = nn.Linear(self.embedding_dim, self.embedding_dim, bias=False)

    def forward(self, token_embeddings, attention_mask: Optional[torch.Tensor] = None,
                compute_attention_matrix: Optional[bool] = False):
        B, T, C = token_embeddings.size()
        label_indices = torch.arange(self.num_classes, dtype=torch.long).expand(B, -1)
        all_label_embeddings = norm(self.label_embeds(label_indices))

        q = self.c_q(all_label_embeddings).view(B, self.num_classes, self.n_head, self.head_dim)
        k = self.c_k(token_embeddings).view(B, T, self.n_head, self.head_dim)
        v = self.c_v(token_embeddings).view(B, T, self.n_head, self.head_dim)
        q, k = norm(q), norm(k)  # QK norm
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

        attn_mask = None
        if attention_mask is not None:
            # attention_mask: (B, T) with 1 for real tokens, 0 for padding
            attn_mask = attention_mask == 1  # (B, T)
            attn_mask = attn_mask.unsqueeze(1).unsqueeze(2)  # (B, 1, 1, T)

        y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=False)
        y = y.transpose(1, 2).contiguous().view(B, self.num_classes, -1)
        y = self.c_proj(y)

        attention_matrix = None
        if compute_attention_matrix:
            # size (B, n_head, n_labels, seq_len)
            attention_scores = torch.matmul(q, k.transpose(-2, -1)) / (self.head_dim**0.5)
            if attention_mask is not None:
                if FIXED:
                    # Set padding positions (where attn_mask is False) to -inf
                    attention_scores = attention_scores.masked_fill(~attn_mask, float("-inf"))
                else:
                    # Set masked positions to -inf so they become 0 after softmax
                    attention_scores = attention_scores.masked_fill(attn_mask, float("-inf"))
            attention_matrix = torch.softmax(attention_scores, dim=-1)

        return {"sentence_embedding": y, "attention_matrix": attention_matrix}


class TextClassifier(nn.Module):
    def __init__(self, vocab_size=50, embedding_dim=32, padding_idx=0, num_classes=4, n_head=4):
        super().__init__()
        self.embedding_layer = nn.Embedding(vocab_size, embedding_dim, padding_idx=padding_idx)
        self.label_attention_module = LabelAttention(embedding_dim, num_classes, n_head)
        self.classification_head = nn.Linear(embedding_dim, 1)

    def forward(self, input_ids, attention_mask, return_label_attention_matrix=False):
        token_embeddings = norm(self.embedding_layer(input_ids))
        out = self.label_attention_module(token_embeddings, attention_mask,
                                          compute_attention_matrix=return_label_attention_matrix)
        logits = self.classification_head(out["sentence_embedding"]).squeeze(-1)  # (B, n_labels)
        return logits, out["attention_matrix"]


def main():
    torch.manual_seed(0)
    model = TextClassifier().eval()
    # padded batch of two texts (right padding with 0) and the collate_fn's attention mask
    input_ids = torch.tensor([[5, 9, 13, 21, 7, 0, 0, 0],
                              [11, 3, 8, 0, 0, 0, 0, 0]])
    attention_mask = (input_ids != 0).long()
    with torch.no_grad():
        logits, attn = model(input_ids, attention_mask, return_label_attention_matrix=True)
    pad_weight = (attn * (attention_mask == 0)[:, None, None, :]).sum(-1).mean().item()
    print(f"{'fixed' if FIXED else 'buggy'}: logits[0]={logits[0].numpy().round(3)}, "
          f"label-attention weight on padding tokens = {pad_weight:.3f}")


if __name__ == "__main__":
    main()
