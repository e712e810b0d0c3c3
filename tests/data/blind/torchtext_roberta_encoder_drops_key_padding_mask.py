# pytorch/text#1758 (commit cfd1ae2, "fix missed mask arg in torchtext transformer"): the RoBERTa/XLM-R
# TransformerEncoder computed padding_mask but called torch.nn.TransformerEncoder without it,
# so real tokens attended to <pad> in a padded batch (classification logits depend on padding).
import sys
from typing import List, Optional, Union

import torch
from torch import nn
from torch.nn import Module

FIXED = "--fixed" in sys.argv


class PositionalEmbedding(Module):
    def __init__(self, num_embeddings: int, embedding_dim: int, pad_index: int) -> None:
        super().__init__()
        self.embedding = nn.Embedding(num_embeddings, embedding_dim, pad_index)
        self.pad_index = pad_index

    def forward(self, input):
        positions = self._make_positions(input, self.pad_index)
        return self.embedding(positions)

    def _make_positions(self, tensor, pad_index: int):
        masked = tensor.ne(pad_index).long()
        return torch.cumsum(masked, dim=1) * masked + pad_index


class TransformerEncoder(Module):
    def __init__(self, vocab_size, embedding_dim, padding_idx, max_seq_len, num_encoder_layers,
                 num_attention_heads, ffn_dimension=None, dropout=0.1, normalize_before=False):
        super().__init__()
        self.padding_idx = padding_idx
        self.token_embedding = nn.Embedding(vocab_size, embedding_dim, padding_idx)
        ffn_dimension = ffn_dimension or 4 * embedding_dim
        layer = torch.nn.TransformerEncoderLayer(
            d_model=embedding_dim, nhead=num_attention_heads, dim_feedforward=ffn_dimension,
            dropout=dropout, activation="gelu", batch_first=True, norm_first=normalize_before,
        )
        self.layers = torch.nn.TransformerEncoder(encoder_layer=layer, num_layers=num_encoder_layers)
        self.positional_embedding = PositionalEmbedding(max_seq_len, embedding_dim, padding_idx)
        self.embedding_layer_norm = nn.LayerNorm(embedding_dim)
        self.dropout = nn.Dropout(dropout)
        self.normalize_before = normalize_before

    def forward(self, tokens: torch.Tensor, attn_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        padding_mask = tokens.eq(self.padding_idx)
        token_embeddings = self.token_embedding(tokens)
        embedded_positions = self.positional_embedding(tokens)
        embedded = token_embeddings + embedded_positions
        if not self.normalize_before:
            embedded = self.embedding_layer_norm(embedded)
        embedded = self.dropout(embedded)
        padded_embedded = embedded * (1 - padding_mask.unsqueeze(-1).type_as(embedded))
        if FIXED:
            encoded = self.layers(padded_embedded, src_key_padding_mask=padding_mask)
        else:
            encoded = self.layers(padded_embedded)
        # B x T x C -> T x B x C
        encoded = encoded.transpose(1, 0)
        if self.normalize_before:
            encoded = self.embedding_layer_norm(encoded)
        return encoded


class RobertaClassificationHead(nn.Module):
    def __init__(self, num_classes, input_dim, inner_dim=None, dropout=0.1):
        super().__init__()
        inner_dim = inner_dim or input_dim
        self.dense = nn.Linear(input_dim, inner_dim)
        self.dropout = nn.Dropout(dropout)
        self.out_proj = nn.Linear(inner_dim, num_classes)
        self.activation_fn = nn.ReLU()

    def forward(self, features):
        x = features[:, 0, :]
        x = self.dropout(x)
        x = self.dense(x)
        x = self.activation_fn(x)
        x = self.dropout(x)
        return self.out_proj(x)


class RobertaModel(Module):
    def __init__(self, encoder_conf: dict, head: Optional[Module] = None):
        super().__init__()
        self.encoder = TransformerEncoder(**encoder_conf)
        self.head = head

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        features = self.encoder(tokens)
        features = features.transpose(1, 0)  # T x B x C -> B x T x C
        if self.head is None:
            return features
        return self.head(features)


def main():
    torch.manual_seed(0)
    pad = 1
    conf = dict(vocab_size=100, embedding_dim=32, padding_idx=pad, max_seq_len=40,
                num_encoder_layers=2, num_attention_heads=4)
    model = RobertaModel(conf, RobertaClassificationHead(num_classes=3, input_dim=32)).eval()

    # two sentences of a batch, the shorter one right-padded with <pad> (=1), as torchtext's
    # to_tensor(padding_value=1) does
    long = torch.tensor([0, 15, 27, 33, 44, 52, 61, 72, 2])
    short = torch.tensor([0, 15, 27, 33, 2])
    batch = torch.full((2, long.numel()), pad)
    batch[0] = long
    batch[1, : short.numel()] = short

    with torch.no_grad():
        logits_batch = model(batch)
        logits_alone = model(short.unsqueeze(0))
    diff = (logits_batch[1] - logits_alone[0]).abs().max().item()
    print(f"{'fixed' if FIXED else 'buggy'}: padded-batch vs unpadded logits of short sentence, max diff {diff:.4f}")


if __name__ == "__main__":
    main()
