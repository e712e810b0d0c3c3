# InseeFrLab/torchTextClassifiers commit 49caf94 ("Apply attention mask in LabelAttentionClassifier
# cross-attention"; mask polarity then settled by #92, commit 9a8b215).
# torchTextClassifiers/model/components/text_embedder.py: TextEmbedder embeds a right-padded batch of
# tokenized texts (pad id = padding_idx, attention_mask 1 = real token) and, with label attention enabled,
# hands the token embeddings to LabelAttentionClassifier, where one learned query per label cross-attends
# over the tokens with F.scaled_dot_product_attention.
# Bug: _get_sentence_embedding called the label attention module with the token embeddings only, and
# LabelAttentionClassifier.forward ran SDPA with no attn_mask, so every label query also attended the pad
# positions of shorter texts (its label-specific sentence embedding, hence its logit, depended on padding).
# Fix: attention_mask is passed down and turned into a boolean (B, 1, 1, T) attn_mask (True = real token).
import sys
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
from torch.nn import functional as F

FIXED = "--fixed" in sys.argv


def norm(x):
    # Purely functional rmsnorm with no learnable params
    return F.rms_norm(x, (x.size(-1),))


@dataclass
class LabelAttentionConfig:
    n_head: int
    n_kv_head: int
    num_classes: int


@dataclass
class TextEmbedderConfig:
    vocab_size: int
    embedding_dim: int
    padding_idx: int
    attention_config: Optional[object] = None
    label_attention_config: Optional[LabelAttentionConfig] = None


class LabelAttentionClassifier(nn.Module):
    def __init__(self, config: TextEmbedderConfig):
        super().__init__()
        label_attention_config = config.label_attention_config
        self.embedding_dim = config.embedding_dim
        self.num_classes = label_attention_config.num_classes
        self.n_head = label_attention_config.n_head
        self.n_kv_head = label_attention_config.n_kv_head
        self.enable_gqa = self.n_head != self.n_kv_head
        self.head_dim = self.embedding_dim // self.n_head

        self.label_embeds = nn.Embedding(self.num_classes, self.embedding_dim)
        self.c_q = nn.Linear(self.embedding_dim, self.n_head * self.head_dim, bias=False)
        self.c_k = nn.Linear(self.embedding_dim, self.n_kv_head * self.head_dim, bias=False)
        self.c_v = nn.Linear(self.embedding_dim, self.n_kv_head * self.head_dim, bias=False)
        self.c_proj = nn.Linear(self.embedding_dim, self.embedding_dim, bias=False)

    def forward(self, token_embeddings, attention_mask=None, compute_attention_matrix=False):
        B, T, C = token_embeddings.size()
        compute_attention_matrix = bool(compute_attention_matrix)

        label_indices = torch.arange(
            self.num_classes, dtype=torch.long, device=token_embeddings.device
        ).expand(B, -1)
        all_label_embeddings = self.label_embeds(label_indices)
        all_label_embeddings = norm(all_label_embeddings)

        q = self.c_q(all_label_embeddings).view(B, self.num_classes, self.n_head, self.head_dim)
        k = self.c_k(token_embeddings).view(B, T, self.n_kv_head, self.head_dim)
        v = self.c_v(token_embeddings).view(B, T, self.n_kv_head, self.head_dim)

        q, k = norm(q), norm(k)  # QK norm
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

        attn_mask = None
        if attention_mask is not None:
            attn_mask = attention_mask == 1  # (B, T)
            attn_mask = attn_mask.unsqueeze(1).unsqueeze(2)  # (B, 1, 1, T)

        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, is_causal=False, enable_gqa=self.enable_gqa
        )
        y = y.transpose(1, 2).contiguous().view(B, self.num_classes, -1)
        y = self.c_proj(y)

        attention_matrix = None
        if compute_attention_matrix:
            attention_scores = torch.matmul(q, k.transpose(-2, -1)) / (self.head_dim**0.5)
            if attn_mask is not None:
                attention_scores = attention_scores.masked_fill(~attn_mask, float("-inf"))
            attention_matrix = torch.softmax(attention_scores, dim=-1)

        return {"sentence_embedding": y, "attention_matrix": attention_matrix}


class TextEmbedder(nn.Module):
    def __init__(self, text_embedder_config: TextEmbedderConfig):
        super().__init__()
        self.config = text_embedder_config
        self.attention_config = text_embedder_config.attention_config
        self.label_attention_config = text_embedder_config.label_attention_config
        self.enable_label_attention = self.label_attention_config is not None
        if self.enable_label_attention:
            self.label_attention_module = LabelAttentionClassifier(self.config)

        self.vocab_size = text_embedder_config.vocab_size
        self.embedding_dim = text_embedder_config.embedding_dim
        self.padding_idx = text_embedder_config.padding_idx
        self.embedding_layer = nn.Embedding(
            embedding_dim=self.embedding_dim,
            num_embeddings=self.vocab_size,
            padding_idx=self.padding_idx,
        )

    def forward(self, input_ids, attention_mask, return_label_attention_matrix=False):
        encoded_text = input_ids
        if encoded_text.dtype != torch.long:
            encoded_text = encoded_text.to(torch.long)

        token_embeddings = self.embedding_layer(encoded_text)
        token_embeddings = norm(token_embeddings)

        out = self._get_sentence_embedding(
            token_embeddings=token_embeddings,
            attention_mask=attention_mask,
            return_label_attention_matrix=return_label_attention_matrix,
        )
        return {
            "sentence_embedding": out["sentence_embedding"],
            "label_attention_matrix": out["label_attention_matrix"],
        }

    def _get_sentence_embedding(self, token_embeddings, attention_mask, return_label_attention_matrix=False):
        if self.enable_label_attention:
            if FIXED:
                label_attention_result = self.label_attention_module(
                    token_embeddings,
                    attention_mask=attention_mask,
                    compute_attention_matrix=return_label_attention_matrix,
                )
            else:
                label_attention_result = self.label_attention_module(
                    token_embeddings, compute_attention_matrix=return_label_attention_matrix
                )
            sentence_embedding = label_attention_result["sentence_embedding"]
            label_attention_matrix = label_attention_result["attention_matrix"]
        else:
            mask = attention_mask.unsqueeze(-1).float()
            masked_embeddings = token_embeddings * mask
            sentence_embedding = masked_embeddings.sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)
            sentence_embedding = torch.nan_to_num(sentence_embedding, 0.0)
            label_attention_matrix = None
        return {
            "sentence_embedding": sentence_embedding,
            "label_attention_matrix": label_attention_matrix,
        }


def collate(texts, padding_idx, max_len):
    # right padding, as the project's tokenizer wrappers return it
    input_ids = torch.full((len(texts), max_len), padding_idx, dtype=torch.long)
    attention_mask = torch.zeros((len(texts), max_len), dtype=torch.long)
    for i, ids in enumerate(texts):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        attention_mask[i, : len(ids)] = 1
    return input_ids, attention_mask


def main():
    torch.manual_seed(0)
    num_classes = 5
    config = TextEmbedderConfig(
        vocab_size=100,
        embedding_dim=32,
        padding_idx=0,
        label_attention_config=LabelAttentionConfig(n_head=4, n_kv_head=4, num_classes=num_classes),
    )
    embedder = TextEmbedder(config).eval()
    # with label attention the classification head is a (d_embed, 1) matrix applied per label
    classification_head = nn.Linear(config.embedding_dim, 1).eval()

    texts = [
        [12, 45, 7, 88, 23, 61, 9, 30],
        [5, 77, 19],
        [41, 2, 66, 14, 90],
    ]
    input_ids, attention_mask = collate(texts, config.padding_idx, max_len=8)

    with torch.no_grad():
        out = embedder(input_ids, attention_mask, return_label_attention_matrix=True)
        logits = classification_head(out["sentence_embedding"]).squeeze(-1)  # (B, num_classes)
        probs = torch.softmax(logits, dim=-1)

    torch.set_printoptions(precision=4, sci_mode=False)
    print("logits:\n", logits)
    print("predicted labels:", probs.argmax(dim=-1).tolist())
    print("attention on padding (label 0, head 0):\n", out["label_attention_matrix"][:, 0, 0, :])


if __name__ == "__main__":
    main()
