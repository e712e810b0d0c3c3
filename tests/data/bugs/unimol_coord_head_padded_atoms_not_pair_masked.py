# Uni-Mol (deepmodeling/Uni-Mol#211, "pad fixing for unimol and docking pose", commit 7394647): the
# masked-coordinate head weights every atom pair by attn_probs = pair2coord_proj(delta_pair_repr) with no pair
# padding mask, so padded atoms (coords 0) pull the real atoms' predicted coordinates in a padded batch.
import sys
from types import SimpleNamespace
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
LayerNorm = nn.LayerNorm


# ---- unicore/modules/multihead_attention.py ----
class SelfMultiheadAttention(nn.Module):
    def __init__(self, embed_dim, num_heads, dropout=0.1, bias=True, scaling_factor=1):
        super().__init__()
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.dropout = dropout
        self.head_dim = embed_dim // num_heads
        self.scaling = (self.head_dim * scaling_factor) ** -0.5
        self.in_proj = nn.Linear(embed_dim, embed_dim * 3, bias=bias)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias)

    def forward(self, query, key_padding_mask: Optional[Tensor] = None, attn_bias: Optional[Tensor] = None,
                return_attn: bool = False):
        bsz, tgt_len, embed_dim = query.size()
        q, k, v = self.in_proj(query).chunk(3, dim=-1)
        q = (q.view(bsz, tgt_len, self.num_heads, self.head_dim).transpose(1, 2).contiguous()
             .view(bsz * self.num_heads, -1, self.head_dim) * self.scaling)
        k = k.view(bsz, -1, self.num_heads, self.head_dim).transpose(1, 2).contiguous().view(bsz * self.num_heads, -1, self.head_dim)
        v = v.view(bsz, -1, self.num_heads, self.head_dim).transpose(1, 2).contiguous().view(bsz * self.num_heads, -1, self.head_dim)
        src_len = k.size(1)
        attn_weights = torch.bmm(q, k.transpose(1, 2))
        if key_padding_mask is not None:
            attn_weights = attn_weights.view(bsz, self.num_heads, tgt_len, src_len)
            attn_weights.masked_fill_(key_padding_mask.unsqueeze(1).unsqueeze(2).to(torch.bool), float("-inf"))
            attn_weights = attn_weights.view(bsz * self.num_heads, tgt_len, src_len)
        if not return_attn:
            attn = F.softmax(attn_weights + attn_bias, dim=-1)
        else:
            attn_weights += attn_bias
            attn = F.softmax(attn_weights, dim=-1)
        attn = F.dropout(attn, self.dropout, self.training)
        o = torch.bmm(attn, v)
        o = o.view(bsz, self.num_heads, tgt_len, self.head_dim).transpose(1, 2).contiguous().view(bsz, tgt_len, embed_dim)
        o = self.out_proj(o)
        if not return_attn:
            return o
        return o, attn_weights, attn


# ---- unicore/modules/transformer_encoder_layer.py (pre-LN) ----
class TransformerEncoderLayer(nn.Module):
    def __init__(self, embed_dim=768, ffn_embed_dim=3072, attention_heads=8, dropout=0.1, attention_dropout=0.1,
                 activation_dropout=0.0, activation_fn="gelu", post_ln=False):
        super().__init__()
        self.dropout = dropout
        self.activation_dropout = activation_dropout
        self.activation_fn = F.gelu
        self.self_attn = SelfMultiheadAttention(embed_dim, attention_heads, dropout=attention_dropout)
        self.self_attn_layer_norm = LayerNorm(embed_dim)
        self.fc1 = nn.Linear(embed_dim, ffn_embed_dim)
        self.fc2 = nn.Linear(ffn_embed_dim, embed_dim)
        self.final_layer_norm = LayerNorm(embed_dim)

    def forward(self, x, attn_bias=None, padding_mask=None, return_attn=False):
        residual = x
        x = self.self_attn_layer_norm(x)
        x, attn_weights, attn_probs = self.self_attn(query=x, key_padding_mask=padding_mask, attn_bias=attn_bias,
                                                     return_attn=return_attn)
        x = residual + F.dropout(x, p=self.dropout, training=self.training)
        residual = x
        x = self.fc2(self.activation_fn(self.fc1(self.final_layer_norm(x))))
        x = residual + F.dropout(x, p=self.dropout, training=self.training)
        return x, attn_weights, attn_probs


# ---- unimol/models/transformer_encoder_with_pair.py (norm losses trimmed) ----
class TransformerEncoderWithPair(nn.Module):
    def __init__(self, encoder_layers=6, embed_dim=768, ffn_embed_dim=3072, attention_heads=8, emb_dropout=0.1,
                 dropout=0.1, attention_dropout=0.1, activation_dropout=0.0, max_seq_len=256, activation_fn="gelu",
                 post_ln=False, no_final_head_layer_norm=False):
        super().__init__()
        self.emb_dropout = emb_dropout
        self.emb_layer_norm = LayerNorm(embed_dim)
        self.final_layer_norm = LayerNorm(embed_dim)
        self.final_head_layer_norm = None if no_final_head_layer_norm else LayerNorm(attention_heads)
        self.layers = nn.ModuleList([
            TransformerEncoderLayer(embed_dim=embed_dim, ffn_embed_dim=ffn_embed_dim, attention_heads=attention_heads,
                                    dropout=dropout, attention_dropout=attention_dropout,
                                    activation_dropout=activation_dropout, activation_fn=activation_fn, post_ln=post_ln)
            for _ in range(encoder_layers)])

    def forward(self, emb, attn_mask=None, padding_mask=None):
        bsz = emb.size(0)
        seq_len = emb.size(1)
        x = self.emb_layer_norm(emb)
        x = F.dropout(x, p=self.emb_dropout, training=self.training)
        if padding_mask is not None:
            x = x * (1 - padding_mask.unsqueeze(-1).type_as(x))
        input_attn_mask = attn_mask
        input_padding_mask = padding_mask

        def fill_attn_mask(attn_mask, padding_mask, fill_val=float("-inf")):
            if attn_mask is not None and padding_mask is not None:
                # merge key_padding_mask and attn_mask
                attn_mask = attn_mask.view(x.size(0), -1, seq_len, seq_len)
                attn_mask.masked_fill_(padding_mask.unsqueeze(1).unsqueeze(2).to(torch.bool), fill_val)
                attn_mask = attn_mask.view(-1, seq_len, seq_len)
                padding_mask = None
            return attn_mask, padding_mask

        attn_mask, padding_mask = fill_attn_mask(attn_mask, padding_mask)
        for i in range(len(self.layers)):
            x, attn_mask, _ = self.layers[i](x, padding_mask=padding_mask, attn_bias=attn_mask, return_attn=True)
        x = self.final_layer_norm(x)
        delta_pair_repr = attn_mask - input_attn_mask
        delta_pair_repr, _ = fill_attn_mask(delta_pair_repr, input_padding_mask, 0)
        attn_mask = attn_mask.view(bsz, -1, seq_len, seq_len).permute(0, 2, 3, 1).contiguous()
        delta_pair_repr = delta_pair_repr.view(bsz, -1, seq_len, seq_len).permute(0, 2, 3, 1).contiguous()
        if self.final_head_layer_norm is not None:
            delta_pair_repr = self.final_head_layer_norm(delta_pair_repr)
        return x, attn_mask, delta_pair_repr, None, None


# ---- unimol/models/unimol.py ----
class NonLinearHead(nn.Module):
    def __init__(self, input_dim, out_dim, activation_fn, hidden=None):
        super().__init__()
        hidden = input_dim if not hidden else hidden
        self.linear1 = nn.Linear(input_dim, hidden)
        self.linear2 = nn.Linear(hidden, out_dim)
        self.activation_fn = F.gelu

    def forward(self, x):
        return self.linear2(self.activation_fn(self.linear1(x)))


def gaussian(x, mean, std):
    pi = 3.14159
    a = (2 * pi) ** 0.5
    return torch.exp(-0.5 * (((x - mean) / std) ** 2)) / (a * std)


class GaussianLayer(nn.Module):
    def __init__(self, K=128, edge_types=1024):
        super().__init__()
        self.K = K
        self.means = nn.Embedding(1, K)
        self.stds = nn.Embedding(1, K)
        self.mul = nn.Embedding(edge_types, 1)
        self.bias = nn.Embedding(edge_types, 1)
        nn.init.uniform_(self.means.weight, 0, 3)
        nn.init.uniform_(self.stds.weight, 0, 3)
        nn.init.constant_(self.bias.weight, 0)
        nn.init.constant_(self.mul.weight, 1)

    def forward(self, x, edge_type):
        mul = self.mul(edge_type).type_as(x)
        bias = self.bias(edge_type).type_as(x)
        x = mul * x.unsqueeze(-1) + bias
        x = x.expand(-1, -1, -1, self.K)
        mean = self.means.weight.float().view(-1)
        std = self.stds.weight.float().view(-1).abs() + 1e-5
        return gaussian(x.float(), mean, std).type_as(self.means.weight)


class UniMolModel(nn.Module):
    def __init__(self, args, dictionary_len, padding_idx=0):
        super().__init__()
        self.args = args
        self.padding_idx = padding_idx
        self.embed_tokens = nn.Embedding(dictionary_len, args.encoder_embed_dim, padding_idx)
        self.encoder = TransformerEncoderWithPair(
            encoder_layers=args.encoder_layers, embed_dim=args.encoder_embed_dim,
            ffn_embed_dim=args.encoder_ffn_embed_dim, attention_heads=args.encoder_attention_heads,
            emb_dropout=0.0, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
            no_final_head_layer_norm=args.delta_pair_repr_norm_loss < 0)
        K = 128
        n_edge_type = dictionary_len * dictionary_len
        self.gbf_proj = NonLinearHead(K, args.encoder_attention_heads, "gelu")
        self.gbf = GaussianLayer(K, n_edge_type)
        self.pair2coord_proj = NonLinearHead(args.encoder_attention_heads, 1, "gelu")

    def forward(self, src_tokens, src_distance, src_coord, src_edge_type):
        padding_mask = src_tokens.eq(self.padding_idx)
        if not padding_mask.any():
            padding_mask = None
        x = self.embed_tokens(src_tokens)

        def get_dist_features(dist, et):
            n_node = dist.size(-1)
            gbf_feature = self.gbf(dist, et)
            gbf_result = self.gbf_proj(gbf_feature)
            graph_attn_bias = gbf_result.permute(0, 3, 1, 2).contiguous()
            return graph_attn_bias.view(-1, n_node, n_node)

        graph_attn_bias = get_dist_features(src_distance, src_edge_type)
        encoder_rep, encoder_pair_rep, delta_encoder_pair_rep, _, _ = self.encoder(
            x, padding_mask=padding_mask, attn_mask=graph_attn_bias)
        encoder_pair_rep[encoder_pair_rep == float("-inf")] = 0

        # masked_coord_loss > 0
        coords_emb = src_coord
        if FIXED:
            if padding_mask is not None:
                atom_num = torch.sum(1 - padding_mask.type_as(x), dim=1).view(-1, 1, 1, 1)  # consider BOS and EOS as part of the object
            else:
                atom_num = src_coord.shape[1]
        else:
            if padding_mask is not None:
                atom_num = (torch.sum(1 - padding_mask.type_as(x), dim=1) - 1).view(-1, 1, 1, 1)
            else:
                atom_num = src_coord.shape[1] - 1
        delta_pos = coords_emb.unsqueeze(1) - coords_emb.unsqueeze(2)
        attn_probs = self.pair2coord_proj(delta_encoder_pair_rep)
        coord_update = delta_pos / atom_num * attn_probs
        if FIXED:
            # Mask padding
            pair_coords_mask = (1 - padding_mask.float()).unsqueeze(-1) * (1 - padding_mask.float()).unsqueeze(1)
            coord_update = coord_update * pair_coords_mask.unsqueeze(-1)
        coord_update = torch.sum(coord_update, dim=2)
        encoder_coord = coords_emb + coord_update
        return encoder_rep, encoder_coord


args = SimpleNamespace(encoder_layers=2, encoder_embed_dim=64, encoder_ffn_embed_dim=128,
                       encoder_attention_heads=8, delta_pair_repr_norm_loss=0.01)
V = 12  # dictionary: 0 [PAD], 1 [CLS], 2 [SEP], 3.. atom types
model = UniMolModel(args, V).eval()


def make_batch(mols, pad_to):
    """Uni-Mol collate: [CLS] atoms [SEP], coords/distances/edge types zero-padded to a multiple of 8."""
    B = len(mols)
    tokens = torch.zeros(B, pad_to, dtype=torch.long)
    coord = torch.zeros(B, pad_to, 3)
    for b, (atoms, xyz) in enumerate(mols):
        n = len(atoms) + 2
        tokens[b, :n] = torch.tensor([1] + atoms + [2])
        coord[b, 1:n - 1] = xyz
        coord[b, 0] = xyz.mean(0)
        coord[b, n - 1] = xyz.mean(0)
    dist = torch.cdist(coord, coord)
    edge = tokens.unsqueeze(-1) * V + tokens.unsqueeze(-2)
    real = tokens.ne(0)
    dist = dist * (real.unsqueeze(-1) & real.unsqueeze(-2))
    edge = edge * (real.unsqueeze(-1) & real.unsqueeze(-2))
    return tokens, dist, coord, edge


small = (torch.randint(3, V, (5,)).tolist(), torch.randn(5, 3) * 1.5)   # 7 tokens
large = (torch.randint(3, V, (13,)).tolist(), torch.randn(13, 3) * 1.5)  # 15 tokens

with torch.no_grad():
    _, coord_batch = model(*make_batch([small, large], pad_to=16))
    _, coord_alone = model(*make_batch([small], pad_to=8))

n = len(small[0]) + 2
diff = (coord_batch[0, :n] - coord_alone[0, :n]).abs().max().item()
print(f"fixed={FIXED}")
print(f"max |predicted coords of the small molecule: batch padded to 16 - alone padded to 8|: {diff:.6f}")
