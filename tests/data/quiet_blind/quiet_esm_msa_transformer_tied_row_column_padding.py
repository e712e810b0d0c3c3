# Citation: facebookresearch/esm esm/axial_attention.py (RowSelfAttention tied attention, ColumnSelfAttention) and
#   esm/model/msa_transformer.py (padding_mask = tokens.eq(padding_idx), embeddings zeroed at padding).
# Masking: an MSA batch padded in both directions (shorter alignment padded with <pad> columns, a smaller MSA padded
#   with whole <pad> rows). Tied row attention zeroes the queries of padded positions before summing logits over the
#   alignment and masks padded columns (from row 0's mask) with -10000; column attention masks padded alignment rows
#   as keys with -10000. Fully padded query rows/columns get a uniform softmax and are discarded.
import math
import torch
import torch.nn as nn

torch.manual_seed(0)


class RowSelfAttention(nn.Module):
    def __init__(self, embed_dim, num_heads, max_tokens_per_msa=2 ** 16):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.scaling = self.head_dim ** -0.5
        self.max_tokens_per_msa = max_tokens_per_msa
        self.attn_shape = "hnij"
        self.k_proj = nn.Linear(embed_dim, embed_dim)
        self.v_proj = nn.Linear(embed_dim, embed_dim)
        self.q_proj = nn.Linear(embed_dim, embed_dim)
        self.out_proj = nn.Linear(embed_dim, embed_dim)

    def align_scaling(self, q):
        num_rows = q.size(0)
        return self.scaling / math.sqrt(num_rows)

    def compute_attention_weights(self, x, scaling, self_attn_mask=None, self_attn_padding_mask=None):
        num_rows, num_cols, batch_size, embed_dim = x.size()
        q = self.q_proj(x).view(num_rows, num_cols, batch_size, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(num_rows, num_cols, batch_size, self.num_heads, self.head_dim)
        q *= scaling
        if self_attn_padding_mask is not None:
            # Zero out any padded aligned positions - this is important since
            # we take a sum across the alignment axis.
            q *= 1 - self_attn_padding_mask.permute(1, 2, 0).unsqueeze(3).unsqueeze(4).to(q)
        attn_weights = torch.einsum(f"rinhd,rjnhd->{self.attn_shape}", q, k)
        if self_attn_mask is not None:
            raise NotImplementedError
        if self_attn_padding_mask is not None:
            attn_weights = attn_weights.masked_fill(self_attn_padding_mask[:, 0].unsqueeze(0).unsqueeze(2), -10000)
        return attn_weights

    def compute_attention_update(self, x, attn_probs):
        num_rows, num_cols, batch_size, embed_dim = x.size()
        v = self.v_proj(x).view(num_rows, num_cols, batch_size, self.num_heads, self.head_dim)
        context = torch.einsum(f"{self.attn_shape},rjnhd->rinhd", attn_probs, v)
        context = context.contiguous().view(num_rows, num_cols, batch_size, embed_dim)
        return self.out_proj(context)

    def forward(self, x, self_attn_mask=None, self_attn_padding_mask=None):
        scaling = self.align_scaling(x)
        attn_weights = self.compute_attention_weights(x, scaling, self_attn_mask, self_attn_padding_mask)
        attn_probs = attn_weights.softmax(-1)
        output = self.compute_attention_update(x, attn_probs)
        return output, attn_probs


class ColumnSelfAttention(nn.Module):
    def __init__(self, embed_dim, num_heads):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.scaling = self.head_dim ** -0.5
        self.k_proj = nn.Linear(embed_dim, embed_dim)
        self.v_proj = nn.Linear(embed_dim, embed_dim)
        self.q_proj = nn.Linear(embed_dim, embed_dim)
        self.out_proj = nn.Linear(embed_dim, embed_dim)

    def forward(self, x, self_attn_mask=None, self_attn_padding_mask=None):
        num_rows, num_cols, batch_size, embed_dim = x.size()
        q = self.q_proj(x).view(num_rows, num_cols, batch_size, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(num_rows, num_cols, batch_size, self.num_heads, self.head_dim)
        v = self.v_proj(x).view(num_rows, num_cols, batch_size, self.num_heads, self.head_dim)
        q *= self.scaling
        attn_weights = torch.einsum("icnhd,jcnhd->hcnij", q, k)
        if self_attn_mask is not None:
            raise NotImplementedError
        if self_attn_padding_mask is not None:
            attn_weights = attn_weights.masked_fill(
                self_attn_padding_mask.permute(2, 0, 1).unsqueeze(0).unsqueeze(3), -10000)
        attn_probs = attn_weights.softmax(-1)
        context = torch.einsum("hcnij,jcnhd->icnhd", attn_probs, v)
        context = context.contiguous().view(num_rows, num_cols, batch_size, embed_dim)
        return self.out_proj(context), attn_probs


class AxialBlock(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.row_self_attention = RowSelfAttention(d, h)
        self.column_self_attention = ColumnSelfAttention(d, h)
        self.n1, self.n2, self.n3 = nn.LayerNorm(d), nn.LayerNorm(d), nn.LayerNorm(d)
        self.ff = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, x, self_attn_padding_mask):
        x = x + self.row_self_attention(self.n1(x), self_attn_padding_mask=self_attn_padding_mask)[0]
        x = x + self.column_self_attention(self.n2(x), self_attn_padding_mask=self_attn_padding_mask)[0]
        return x + self.ff(self.n3(x))


class MSATransformer(nn.Module):
    def __init__(self, alphabet_size=33, padding_idx=1, d=32, h=4, layers=2):
        super().__init__()
        self.padding_idx = padding_idx
        self.embed_tokens = nn.Embedding(alphabet_size, d, padding_idx=padding_idx)
        self.layers = nn.ModuleList([AxialBlock(d, h) for _ in range(layers)])
        self.lm_head = nn.Linear(d, alphabet_size)

    def forward(self, tokens):
        batch_size, num_alignments, seqlen = tokens.size()
        padding_mask = tokens.eq(self.padding_idx)  # B, R, C
        if not padding_mask.any():
            padding_mask = None
        x = self.embed_tokens(tokens)
        if padding_mask is not None:
            x = x * (1 - padding_mask.unsqueeze(-1).type_as(x))
        # B x R x C x D -> R x C x B x D
        x = x.permute(1, 2, 0, 3)
        for layer in self.layers:
            x = layer(x, self_attn_padding_mask=padding_mask)
        x = x.permute(2, 0, 1, 3)
        return self.lm_head(x)


model = MSATransformer()
B, R, C = 2, 4, 10
tokens = torch.randint(4, 24, (B, R, C))
tokens[:, :, 0] = 0  # <cls> per alignment row
tokens[0, :, 7:] = 1  # MSA 0 is 6 residues long: padded columns
tokens[1, 3:, :] = 1  # MSA 1 has 3 sequences: padded row
targets = tokens.clone()
mask = (torch.rand(B, R, C) < 0.2) & (tokens > 3)
mask[0, 0, 2] = True
tokens = tokens.masked_fill(mask, 32)
logits = model(tokens)
loss = nn.functional.cross_entropy(logits[mask], targets[mask])
loss.backward()
print(f"msa mlm loss {loss.item():.4f}")
