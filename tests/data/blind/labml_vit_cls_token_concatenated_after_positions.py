"""labml.ai annotated ViT: the [CLS] token was concatenated after the learned positions were added.

Citation: labmlai/annotated_deep_learning_paper_implementations#221 (merged; commit ffafaf1 "fix: fix cls_token
bug in vit."), labml_nn/transformers/vit/__init__.py, ``VisionTransformer.forward``.

The bug: ``forward`` ran ``x = self.pos_emb(x)`` on the patch embeddings alone and then prepended the ``[CLS]``
token. ``LearnedPositionalEmbeddings`` adds ``positional_encodings[:x.shape[0]]``, so the patches took rows
0 .. N-1 of the table and the ``[CLS]`` token (sequence slot 0) took none, every patch shifted one row from the
layout the ViT paper (and the tutorial's own text) uses.

The fix: concatenate ``[CLS]`` first, then add the positional embeddings, so ``[CLS]`` gets row 0 and the
patches rows 1 .. N.

The modules are ported as the tutorial wrote them (labml_nn/transformers/mha.py, models.py, feed_forward.py:
sequence-first ``[seq, batch, d_model]`` tensors, einsum attention with softmax over the key axis ``dim=1``,
pre-norm TransformerLayer called with ``mask=None``), at toy sizes: 16x16 images, patch 4 (16 patches),
d_model 32. The positional table is zeros at init in the tutorial; a trained checkpoint holds learned rows, so
the program fills the table (and the rest of the weights) from a seeded random "checkpoint", then runs a few
Adam steps of the CIFAR-10 style training loop and an evaluation.
"""

import copy
import math
import sys
from typing import List, Optional

import torch
from torch import nn

FIXED = "--fixed" in sys.argv


def clone_module_list(module: nn.Module, n: int) -> nn.ModuleList:
    # labml_nn/utils.py
    return nn.ModuleList([copy.deepcopy(module) for _ in range(n)])


class PrepareForMultiHeadAttention(nn.Module):
    def __init__(self, d_model: int, heads: int, d_k: int, bias: bool):
        super().__init__()
        self.linear = nn.Linear(d_model, heads * d_k, bias=bias)
        self.heads = heads
        self.d_k = d_k

    def forward(self, x: torch.Tensor):
        head_shape = x.shape[:-1]
        x = self.linear(x)
        x = x.view(*head_shape, self.heads, self.d_k)
        return x


class MultiHeadAttention(nn.Module):
    def __init__(self, heads: int, d_model: int, dropout_prob: float = 0.1, bias: bool = True):
        super().__init__()
        self.d_k = d_model // heads
        self.heads = heads
        self.query = PrepareForMultiHeadAttention(d_model, heads, self.d_k, bias=bias)
        self.key = PrepareForMultiHeadAttention(d_model, heads, self.d_k, bias=bias)
        self.value = PrepareForMultiHeadAttention(d_model, heads, self.d_k, bias=True)
        self.softmax = nn.Softmax(dim=1)
        self.output = nn.Linear(d_model, d_model)
        self.dropout = nn.Dropout(dropout_prob)
        self.scale = 1 / math.sqrt(self.d_k)
        self.attn = None

    def get_scores(self, query: torch.Tensor, key: torch.Tensor):
        return torch.einsum('ibhd,jbhd->ijbh', query, key)

    def prepare_mask(self, mask: torch.Tensor, query_shape: List[int], key_shape: List[int]):
        assert mask.shape[0] == 1 or mask.shape[0] == query_shape[0]
        assert mask.shape[1] == key_shape[0]
        assert mask.shape[2] == 1 or mask.shape[2] == query_shape[1]
        mask = mask.unsqueeze(-1)
        return mask

    def forward(self, *,
                query: torch.Tensor,
                key: torch.Tensor,
                value: torch.Tensor,
                mask: Optional[torch.Tensor] = None):
        seq_len, batch_size, _ = query.shape
        if mask is not None:
            mask = self.prepare_mask(mask, query.shape, key.shape)
        query = self.query(query)
        key = self.key(key)
        value = self.value(value)
        scores = self.get_scores(query, key)
        scores *= self.scale
        if mask is not None:
            scores = scores.masked_fill(mask == 0, float('-inf'))
        attn = self.softmax(scores)
        attn = self.dropout(attn)
        x = torch.einsum("ijbh,jbhd->ibhd", attn, value)
        self.attn = attn.detach()
        x = x.reshape(seq_len, batch_size, -1)
        return self.output(x)


class FeedForward(nn.Module):
    def __init__(self, d_model: int, d_ff: int, dropout: float = 0.1, activation=nn.ReLU()):
        super().__init__()
        self.layer1 = nn.Linear(d_model, d_ff)
        self.layer2 = nn.Linear(d_ff, d_model)
        self.dropout = nn.Dropout(dropout)
        self.activation = activation

    def forward(self, x: torch.Tensor):
        x = self.activation(self.layer1(x))
        x = self.dropout(x)
        return self.layer2(x)


class TransformerLayer(nn.Module):
    def __init__(self, *,
                 d_model: int,
                 self_attn: MultiHeadAttention,
                 feed_forward: FeedForward,
                 dropout_prob: float):
        super().__init__()
        self.size = d_model
        self.self_attn = self_attn
        self.feed_forward = feed_forward
        self.dropout = nn.Dropout(dropout_prob)
        self.norm_self_attn = nn.LayerNorm([d_model])
        self.norm_ff = nn.LayerNorm([d_model])

    def forward(self, *, x: torch.Tensor, mask: Optional[torch.Tensor]):
        z = self.norm_self_attn(x)
        self_attn = self.self_attn(query=z, key=z, value=z, mask=mask)
        x = x + self.dropout(self_attn)
        z = self.norm_ff(x)
        ff = self.feed_forward(z)
        x = x + self.dropout(ff)
        return x


class PatchEmbeddings(nn.Module):
    def __init__(self, d_model: int, patch_size: int, in_channels: int):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, d_model, patch_size, stride=patch_size)

    def forward(self, x: torch.Tensor):
        x = self.conv(x)
        bs, c, h, w = x.shape
        # Rearrange to shape `[patches, batch_size, d_model]`
        x = x.permute(2, 3, 0, 1)
        x = x.view(h * w, bs, c)
        return x


class LearnedPositionalEmbeddings(nn.Module):
    def __init__(self, d_model: int, max_len: int = 5_000):
        super().__init__()
        self.positional_encodings = nn.Parameter(torch.zeros(max_len, 1, d_model), requires_grad=True)

    def forward(self, x: torch.Tensor):
        # Get the positional embeddings for the given patches
        pe = self.positional_encodings[:x.shape[0]]
        return x + pe


class ClassificationHead(nn.Module):
    def __init__(self, d_model: int, n_hidden: int, n_classes: int):
        super().__init__()
        self.linear1 = nn.Linear(d_model, n_hidden)
        self.act = nn.ReLU()
        self.linear2 = nn.Linear(n_hidden, n_classes)

    def forward(self, x: torch.Tensor):
        x = self.act(self.linear1(x))
        x = self.linear2(x)
        return x


class VisionTransformer(nn.Module):
    def __init__(self, transformer_layer: TransformerLayer, n_layers: int,
                 patch_emb: PatchEmbeddings, pos_emb: LearnedPositionalEmbeddings,
                 classification: ClassificationHead):
        super().__init__()
        self.patch_emb = patch_emb
        self.pos_emb = pos_emb
        self.classification = classification
        self.transformer_layers = clone_module_list(transformer_layer, n_layers)
        self.cls_token_emb = nn.Parameter(torch.randn(1, 1, transformer_layer.size), requires_grad=True)
        self.ln = nn.LayerNorm([transformer_layer.size])

    def forward(self, x: torch.Tensor):
        # Get patch embeddings. This gives a tensor of shape `[patches, batch_size, d_model]`
        x = self.patch_emb(x)
        if FIXED:
            # Concatenate the `[CLS]` token embeddings before feeding the transformer
            cls_token_emb = self.cls_token_emb.expand(-1, x.shape[1], -1)
            x = torch.cat([cls_token_emb, x])
            # Add positional embeddings
            x = self.pos_emb(x)
        else:
            # Add positional embeddings
            x = self.pos_emb(x)
            # Concatenate the `[CLS]` token embeddings before feeding the transformer
            cls_token_emb = self.cls_token_emb.expand(-1, x.shape[1], -1)
            x = torch.cat([cls_token_emb, x])

        # Pass through transformer layers with no attention masking
        for layer in self.transformer_layers:
            x = layer(x=x, mask=None)

        # Get the transformer output of the `[CLS]` token (which is the first in the sequence).
        x = x[0]
        x = self.ln(x)
        x = self.classification(x)
        return x


def build_model(d_model=32, n_heads=4, d_ff=64, n_layers=2, dropout=0.1, patch_size=4,
                n_hidden_classification=64, n_classes=10):
    # labml_nn/transformers/configs.py (encoder_layer) and vit/experiment.py (_vit)
    layer = TransformerLayer(d_model=d_model,
                             self_attn=MultiHeadAttention(n_heads, d_model, dropout_prob=dropout),
                             feed_forward=FeedForward(d_model, d_ff, dropout=dropout),
                             dropout_prob=dropout)
    return VisionTransformer(layer, n_layers,
                             PatchEmbeddings(d_model, patch_size, 3),
                             LearnedPositionalEmbeddings(d_model),
                             ClassificationHead(d_model, n_hidden_classification, n_classes))


def main():
    torch.manual_seed(0)
    model = build_model()
    # A trained checkpoint: learned positional rows instead of the zeros the table starts from.
    with torch.no_grad():
        model.pos_emb.positional_encodings[:64].normal_(0.0, 0.5)

    images = torch.randn(8, 3, 16, 16)
    labels = torch.randint(0, 10, (8,))

    optimizer = torch.optim.Adam(model.parameters(), lr=2.5e-4)
    loss_func = nn.CrossEntropyLoss()
    model.train()
    for step in range(3):
        optimizer.zero_grad()
        output = model(images)
        loss = loss_func(output, labels)
        loss.backward()
        optimizer.step()
        print(f"step {step}: loss {loss.item():.6f}")

    model.eval()
    with torch.no_grad():
        logits = model(images[:4])
    print("eval logits[0]:", [round(v, 4) for v in logits[0].tolist()])
    print("eval predictions:", logits.argmax(-1).tolist())


if __name__ == "__main__":
    main()
