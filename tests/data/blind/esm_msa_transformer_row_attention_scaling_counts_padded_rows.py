# Citation: facebookresearch/esm#491 ("Padding in MSA can lead to inconsistent results compared to MSA
# without padding"; open issue, source read at a01925e7508064e08a5b14e09f2284ef26418b81; the fix is the
# one the issue asks for, written here).
# Upstream: esm/axial_attention.py RowSelfAttention.align_scaling / compute_attention_weights (tied row
# attention), called from esm/model/msa_transformer.py MSATransformer.forward with
# padding_mask = tokens.eq(padding_idx) over a batch made by MSABatchConverter.
# Bug: tied row attention sums the logits over every row of the MSA and divides by sqrt(num_rows), where
# num_rows = q.size(0) is the padded row count of the whole batch. The padding mask zeroes the padded rows'
# queries, so they add nothing to the sum, but they are still counted in the normaliser: an MSA with fewer
# alignments than the deepest one in its batch is attended with a smaller, wrong scale.
# Fix: take the number of rows per MSA from the padding mask (rows that hold any non-padding token) and
# scale each MSA's queries by scaling / sqrt(its own row count).
import math
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class RowSelfAttention(nn.Module):
    """Compute self-attention over rows of a 2D input."""

    def __init__(self, embed_dim, num_heads, dropout=0.0, max_tokens_per_msa: int = 2 ** 16):
        super().__init__()
        self.num_heads = num_heads
        self.dropout = dropout
        self.head_dim = embed_dim // num_heads
        self.scaling = self.head_dim ** -0.5
        self.max_tokens_per_msa = max_tokens_per_msa
        self.attn_shape = "hnij"

        self.k_proj = nn.Linear(embed_dim, embed_dim)
        self.v_proj = nn.Linear(embed_dim, embed_dim)
        self.q_proj = nn.Linear(embed_dim, embed_dim)
        self.out_proj = nn.Linear(embed_dim, embed_dim)
        self.dropout_module = nn.Dropout(dropout)

    def align_scaling(self, q, self_attn_padding_mask=None):
        if FIXED and self_attn_padding_mask is not None:
            # rows of an MSA that hold at least one real token: (B,)
            num_rows = (~self_attn_padding_mask).any(-1).sum(-1)
            return self.scaling / torch.sqrt(num_rows.to(q))
        num_rows = q.size(0)
        return self.scaling / math.sqrt(num_rows)

    def forward(self, x, self_attn_mask=None, self_attn_padding_mask=None):
        num_rows, num_cols, batch_size, embed_dim = x.size()
        scaling = self.align_scaling(x, self_attn_padding_mask)
        attn_weights = self.compute_attention_weights(x, scaling, self_attn_mask, self_attn_padding_mask)
        attn_probs = attn_weights.softmax(-1)
        attn_probs = self.dropout_module(attn_probs)
        output = self.compute_attention_update(x, attn_probs)
        return output, attn_probs

    def compute_attention_weights(self, x, scaling, self_attn_mask=None, self_attn_padding_mask=None):
        num_rows, num_cols, batch_size, embed_dim = x.size()
        q = self.q_proj(x).view(num_rows, num_cols, batch_size, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(num_rows, num_cols, batch_size, self.num_heads, self.head_dim)
        if torch.is_tensor(scaling):
            scaling = scaling.view(1, 1, batch_size, 1, 1)
        q *= scaling
        if self_attn_padding_mask is not None:
            # Zero out any padded aligned positions - this is important since
            # we take a sum across the alignment axis.
            q *= 1 - self_attn_padding_mask.permute(1, 2, 0).unsqueeze(3).unsqueeze(4).to(q)

        attn_weights = torch.einsum(f"rinhd,rjnhd->{self.attn_shape}", q, k)

        if self_attn_mask is not None:
            raise NotImplementedError
            # Mask Size: [B x R x C], Weights Size: [H x B x C x C]

        if self_attn_padding_mask is not None:
            attn_weights = attn_weights.masked_fill(
                self_attn_padding_mask[:, 0].unsqueeze(0).unsqueeze(2),
                -10000,
            )

        return attn_weights

    def compute_attention_update(self, x, attn_probs):
        num_rows, num_cols, batch_size, embed_dim = x.size()
        v = self.v_proj(x).view(num_rows, num_cols, batch_size, self.num_heads, self.head_dim)
        context = torch.einsum(f"{self.attn_shape},rjnhd->rinhd", attn_probs, v)
        context = context.contiguous().view(num_rows, num_cols, batch_size, embed_dim)
        output = self.out_proj(context)
        return output


class ColumnSelfAttention(nn.Module):
    """Compute self-attention over columns of a 2D input."""

    def __init__(self, embed_dim, num_heads, dropout=0.0, max_tokens_per_msa: int = 2 ** 16):
        super().__init__()
        self.num_heads = num_heads
        self.dropout = dropout
        self.head_dim = embed_dim // num_heads
        self.scaling = self.head_dim ** -0.5
        self.max_tokens_per_msa = max_tokens_per_msa

        self.k_proj = nn.Linear(embed_dim, embed_dim)
        self.v_proj = nn.Linear(embed_dim, embed_dim)
        self.q_proj = nn.Linear(embed_dim, embed_dim)
        self.out_proj = nn.Linear(embed_dim, embed_dim)
        self.dropout_module = nn.Dropout(dropout)

    def forward(self, x, self_attn_mask=None, self_attn_padding_mask=None):
        return self.compute_attention_update(x, self_attn_mask, self_attn_padding_mask)

    def compute_attention_update(self, x, self_attn_mask=None, self_attn_padding_mask=None):
        num_rows, num_cols, batch_size, embed_dim = x.size()
        if num_rows == 1:
            attn_probs = torch.ones(
                self.num_heads, num_cols, batch_size, num_rows, num_rows, device=x.device, dtype=x.dtype
            )
            output = self.out_proj(self.v_proj(x))
        else:
            q = self.q_proj(x).view(num_rows, num_cols, batch_size, self.num_heads, self.head_dim)
            k = self.k_proj(x).view(num_rows, num_cols, batch_size, self.num_heads, self.head_dim)
            v = self.v_proj(x).view(num_rows, num_cols, batch_size, self.num_heads, self.head_dim)
            q *= self.scaling

            attn_weights = torch.einsum("icnhd,jcnhd->hcnij", q, k)

            if self_attn_mask is not None:
                raise NotImplementedError
            if self_attn_padding_mask is not None:
                attn_weights = attn_weights.masked_fill(
                    self_attn_padding_mask.permute(2, 0, 1).unsqueeze(0).unsqueeze(3),
                    -10000,
                )

            attn_probs = attn_weights.softmax(-1)
            attn_probs = self.dropout_module(attn_probs)
            context = torch.einsum("hcnij,jcnhd->icnhd", attn_probs, v)
            context = context.contiguous().view(num_rows, num_cols, batch_size, embed_dim)
            output = self.out_proj(context)
        return output, attn_probs


class FeedForwardNetwork(nn.Module):
    def __init__(self, embedding_dim, ffn_embedding_dim, activation_dropout=0.1):
        super().__init__()
        self.activation_fn = nn.GELU()
        self.activation_dropout_module = nn.Dropout(activation_dropout)
        self.fc1 = nn.Linear(embedding_dim, ffn_embedding_dim)
        self.fc2 = nn.Linear(ffn_embedding_dim, embedding_dim)

    def forward(self, x):
        x = self.activation_fn(self.fc1(x))
        x = self.activation_dropout_module(x)
        x = self.fc2(x)
        return x


class NormalizedResidualBlock(nn.Module):
    def __init__(self, layer, embedding_dim, dropout=0.1):
        super().__init__()
        self.layer = layer
        self.dropout_module = nn.Dropout(dropout)
        self.layer_norm = nn.LayerNorm(embedding_dim)

    def forward(self, x, *args, **kwargs):
        residual = x
        x = self.layer_norm(x)
        outputs = self.layer(x, *args, **kwargs)
        if isinstance(outputs, tuple):
            x, *out = outputs
        else:
            x = outputs
            out = None
        x = self.dropout_module(x)
        x = residual + x
        if out is not None:
            return (x,) + tuple(out)
        return x


class AxialTransformerLayer(nn.Module):
    """Implements an Axial MSA Transformer block."""

    def __init__(self, embedding_dim, ffn_embedding_dim, num_attention_heads, dropout=0.0,
                 attention_dropout=0.0, activation_dropout=0.0, max_tokens_per_msa=2 ** 14):
        super().__init__()
        row_self_attention = RowSelfAttention(embedding_dim, num_attention_heads, dropout=dropout,
                                              max_tokens_per_msa=max_tokens_per_msa)
        column_self_attention = ColumnSelfAttention(embedding_dim, num_attention_heads, dropout=dropout,
                                                    max_tokens_per_msa=max_tokens_per_msa)
        feed_forward_layer = FeedForwardNetwork(embedding_dim, ffn_embedding_dim,
                                                activation_dropout=activation_dropout)
        self.row_self_attention = NormalizedResidualBlock(row_self_attention, embedding_dim, dropout)
        self.column_self_attention = NormalizedResidualBlock(column_self_attention, embedding_dim, dropout)
        self.feed_forward_layer = NormalizedResidualBlock(feed_forward_layer, embedding_dim, dropout)

    def forward(self, x, self_attn_mask=None, self_attn_padding_mask=None, need_head_weights=False):
        x, row_attn = self.row_self_attention(x, self_attn_mask=self_attn_mask,
                                              self_attn_padding_mask=self_attn_padding_mask)
        x, column_attn = self.column_self_attention(x, self_attn_mask=self_attn_mask,
                                                    self_attn_padding_mask=self_attn_padding_mask)
        x = self.feed_forward_layer(x)
        if need_head_weights:
            return x, column_attn, row_attn
        return x


class LearnedPositionalEmbedding(nn.Embedding):
    def __init__(self, num_embeddings, embedding_dim, padding_idx):
        if padding_idx is not None:
            num_embeddings_ = num_embeddings + padding_idx + 1
        else:
            num_embeddings_ = num_embeddings
        super().__init__(num_embeddings_, embedding_dim, padding_idx)
        self.max_positions = num_embeddings

    def forward(self, input):
        mask = input.ne(self.padding_idx).int()
        positions = (torch.cumsum(mask, dim=1).type_as(mask) * mask).long() + self.padding_idx
        return F.embedding(positions, self.weight, self.padding_idx)


class MSATransformer(nn.Module):
    def __init__(self, alphabet_size=33, padding_idx=1, mask_idx=32, cls_idx=0, eos_idx=2,
                 embed_dim=32, layers=2, attention_heads=4, ffn_embed_dim=64, max_positions=64):
        super().__init__()
        self.padding_idx = padding_idx
        self.embed_tokens = nn.Embedding(alphabet_size, embed_dim, padding_idx=padding_idx)
        self.msa_position_embedding = nn.Parameter(0.01 * torch.randn(1, 1024, 1, 1), requires_grad=True)
        self.dropout_module = nn.Dropout(0.0)
        self.layers = nn.ModuleList(
            [AxialTransformerLayer(embed_dim, ffn_embed_dim, attention_heads) for _ in range(layers)]
        )
        self.embed_positions = LearnedPositionalEmbedding(max_positions, embed_dim, padding_idx)
        self.emb_layer_norm_before = nn.LayerNorm(embed_dim)
        self.emb_layer_norm_after = nn.LayerNorm(embed_dim)
        self.lm_head = nn.Linear(embed_dim, alphabet_size)

    def forward(self, tokens):
        assert tokens.ndim == 3
        batch_size, num_alignments, seqlen = tokens.size()
        padding_mask = tokens.eq(self.padding_idx)  # B, R, C
        if not padding_mask.any():
            padding_mask = None

        x = self.embed_tokens(tokens)
        x += self.embed_positions(tokens.view(batch_size * num_alignments, seqlen)).view(x.size())
        x += self.msa_position_embedding[:, :num_alignments]

        x = self.emb_layer_norm_before(x)
        x = self.dropout_module(x)

        if padding_mask is not None:
            x = x * (1 - padding_mask.unsqueeze(-1).type_as(x))

        # B x R x C x D -> R x C x B x D
        x = x.permute(1, 2, 0, 3)
        for layer in self.layers:
            x = layer(x, self_attn_padding_mask=padding_mask)

        x = self.emb_layer_norm_after(x)
        x = x.permute(2, 0, 1, 3)  # R x C x B x D -> B x R x C x D
        x = self.lm_head(x)
        return {"logits": x}


def msa_batch_converter(msas, padding_idx=1, cls_idx=0):
    """MSABatchConverter: every row gets <cls> prepended; MSAs are padded to the deepest / longest one."""
    batch_size = len(msas)
    max_alignments = max(len(m) for m in msas)
    max_seqlen = max(len(m[0]) for m in msas)
    tokens = torch.full((batch_size, max_alignments, max_seqlen + 1), padding_idx, dtype=torch.long)
    for i, msa in enumerate(msas):
        for r, row in enumerate(msa):
            tokens[i, r, 0] = cls_idx
            tokens[i, r, 1:1 + len(row)] = torch.tensor(row)
    return tokens


model = MSATransformer().eval()

# two MSAs of the same length: one with 6 alignments, one with 2 (padded to 6 rows in the batch)
g = torch.Generator().manual_seed(1)
query = torch.randint(4, 24, (10,), generator=g).tolist()
msa_deep = [query] + [torch.randint(4, 24, (10,), generator=g).tolist() for _ in range(5)]
msa_shallow = [query, torch.randint(4, 24, (10,), generator=g).tolist()]

batch_tokens = msa_batch_converter([msa_deep, msa_shallow])
alone_tokens = msa_batch_converter([msa_shallow])

with torch.no_grad():
    batch_logits = model(batch_tokens)["logits"]
    alone_logits = model(alone_tokens)["logits"]

    targets = alone_tokens[0, 0, 1:]
    loss_batched = F.cross_entropy(batch_logits[1, 0, 1:], targets)
    loss_alone = F.cross_entropy(alone_logits[0, 0, 1:], targets)

print("batch tokens shape:", tuple(batch_tokens.shape))
print("shallow MSA query-row logits[0, :4] in batch :", [round(v, 4) for v in batch_logits[1, 0, 1, :4].tolist()])
print("shallow MSA query-row logits[0, :4] alone    :", [round(v, 4) for v in alone_logits[0, 0, 1, :4].tolist()])
print(f"query-row NLL in batch {loss_batched.item():.5f}  alone {loss_alone.item():.5f}")
print("max |batch - alone| over the shallow MSA's rows:",
      f"{(batch_logits[1, :2] - alone_logits[0, :2]).abs().max().item():.6f}")
