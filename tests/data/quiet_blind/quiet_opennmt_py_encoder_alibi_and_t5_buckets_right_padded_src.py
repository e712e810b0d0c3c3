# Citation: OpenNMT/OpenNMT-py @v3.5.1 (3f0c5f7c24c0a26e7165e054cd8000e18b931799): onmt/modules/multi_headed_attn.py
#   (_relative_position_bucket, compute_bias, shape / unshape, MultiHeadedAttention.forward, its eager path),
#   onmt/modules/alibi_position_bias.py (AlibiPositionalBias), onmt/encoders/transformer.py (TransformerEncoderLayer,
#   TransformerEncoder.forward), onmt/modules/position_ffn.py (PositionwiseFeedForward), onmt/utils/misc.py
#   (sequence_mask).
# OpenNMT-py's Transformer encoder over a right-padded source batch with its two position-bias options, each set the
# way the yaml sets them: `max_relative_positions: -2` (ALiBi: per-head slopes times -|j - i|, a symmetric bias
# cached in a buffer and sliced [:i, :j] when a later batch is shorter) and `relative_positions_buckets: 16` with
# `max_relative_positions: 20` (T5-style bidirectional buckets, an nn.Embedding(buckets, heads) in every layer). The
# bias is added to the scores, then `sequence_mask(src_len)` (True = padding), widened to (B, 1, S, S) and expanded
# over the heads, fills the padded keys with -1e18 before the softmax. No positional embedding is added to the words.
# skip_init(nn.Linear, ...) is written as nn.Linear, and onmt's Embeddings (no position encoding) as its word_lut.
# Self-check: each source encoded alone at its own length gives the same states at its real tokens, for both options,
# and the ALiBi bias built here equals slope_h * -|j - i| written as a double loop.
import math
from math import log, sqrt
from typing import Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

torch.manual_seed(0)


# ---- onmt/utils/misc.py ----
def sequence_mask(lengths, max_len=None):
    """
    Creates a boolean mask from sequence lengths.
    """
    max_len = max_len or lengths.max()
    return torch.arange(0, max_len, device=lengths.device) >= lengths.unsqueeze(1)


# ---- onmt/modules/alibi_position_bias.py ----
def pad_at_dim(t, pad, dim=-1, value=0.0):
    dims_from_right = (-dim - 1) if dim < 0 else (t.ndim - dim - 1)
    zeros = (0, 0) * dims_from_right
    return F.pad(t, (*zeros, *pad), value=value)


class AlibiPositionalBias(nn.Module):
    def __init__(self, heads, **kwargs):
        super().__init__()
        self.heads = heads
        slopes = torch.Tensor(self._get_slopes(heads))
        slopes = slopes.unsqueeze(1).unsqueeze(1)
        self.register_buffer("slopes", slopes, persistent=False)
        self.register_buffer("bias", None, persistent=False)

    def get_bias(self, i, j, device):
        i_arange = torch.arange(j - i, j, device=device)
        j_arange = torch.arange(j, device=device)
        bias = -torch.abs(j_arange.unsqueeze(0).unsqueeze(0) - i_arange.unsqueeze(1).unsqueeze(0))
        return bias

    @staticmethod
    def _get_slopes(heads):
        def get_slopes_power_of_2(n):
            start = 2 ** (-(2 ** -(math.log2(n) - 3)))
            ratio = start
            return [start * ratio**i for i in range(n)]

        if math.log2(heads).is_integer():
            return get_slopes_power_of_2(heads)
        closest_power_of_2 = 2 ** math.floor(math.log2(heads))

        return (
            get_slopes_power_of_2(closest_power_of_2)
            + get_slopes_power_of_2(2 * closest_power_of_2)[0::2][: heads - closest_power_of_2]
        )

    def forward(self, qk_dots):
        h, i, j, device = *qk_dots.shape[-3:], qk_dots.device

        if (self.bias is not None) and self.bias.shape[-1] >= j:
            return qk_dots + self.bias[..., :i, :j]

        bias = self.get_bias(i, j, device)
        bias = bias * self.slopes

        num_heads_unalibied = h - bias.shape[0]
        bias = pad_at_dim(bias, (0, num_heads_unalibied), dim=0)
        self.register_buffer("bias", bias, persistent=False)

        return qk_dots + self.bias


# ---- onmt/modules/multi_headed_attn.py ----
def _relative_position_bucket(relative_position, bidirectional=True, num_buckets=32, max_distance=128):
    relative_buckets = 0
    if bidirectional:
        num_buckets //= 2
        relative_buckets += (relative_position > 0).to(torch.long) * num_buckets
        relative_position = torch.abs(relative_position)
    else:
        relative_position = -torch.min(relative_position, torch.zeros_like(relative_position))
    # now relative_position is in the range [0, inf)
    # half of the buckets are for exact increments in positions
    max_exact = num_buckets // 2
    is_small = relative_position < max_exact

    # The other half of the buckets are for logarithmically bigger bins in positions
    # up to max_distance
    relative_position_if_large = max_exact + (
        torch.log(relative_position.float() / max_exact)
        / log(max_distance / max_exact)
        * (num_buckets - max_exact)
    ).to(torch.long)
    relative_position_if_large = torch.min(
        relative_position_if_large,
        torch.full_like(relative_position_if_large, num_buckets - 1),
    )

    relative_buckets += torch.where(is_small, relative_position, relative_position_if_large)
    return relative_buckets


def compute_bias(query_length, key_length, is_decoder, max_relative_positions, relative_positions_buckets,
                 device=None):
    """Compute binned relative position bias"""
    context_position = torch.arange(query_length, dtype=torch.long, device=device)[:, None]
    memory_position = torch.arange(key_length, dtype=torch.long, device=device)[None, :]
    relative_position = memory_position - context_position  # shape (query_length, key_length)
    relative_position_bucket = _relative_position_bucket(
        relative_position,  # shape (query_length, key_length)
        bidirectional=(not is_decoder),
        num_buckets=relative_positions_buckets,
        max_distance=max_relative_positions,
    )
    return relative_position_bucket


def shape(x: Tensor, dim_per_head: int) -> Tensor:
    x_0, x_1, _ = x.size()
    return x.view(x_0, x_1, -1, dim_per_head).transpose(1, 2)


def unshape(x: Tensor) -> Tensor:
    x_0, x_1, _, x_3 = x.size()
    return x.transpose(1, 2).contiguous().view(x_0, -1, x_1 * x_3)


class MultiHeadedAttention(torch.nn.Module):
    def __init__(self, head_count, model_dim, dropout=0.1, is_decoder=True, max_relative_positions=0,
                 relative_positions_buckets=0, attn_type=None, self_attn_type=None, add_qkvbias=False):
        assert model_dim % head_count == 0, "Model dimension must be divisible by the number of heads"
        self.dim_per_head = model_dim // head_count
        super(MultiHeadedAttention, self).__init__()
        self.head_count = head_count
        self.parallel_gpu = 1
        self.linear_keys = nn.Linear(model_dim, model_dim, bias=add_qkvbias)
        self.linear_values = nn.Linear(model_dim, model_dim, bias=add_qkvbias)
        self.linear_query = nn.Linear(model_dim, model_dim, bias=add_qkvbias)
        self.softmax = nn.Softmax(dim=-1)
        self.dropout = nn.Dropout(dropout)
        self.dropout_p = dropout
        self.final_linear = nn.Linear(model_dim, model_dim, bias=add_qkvbias)
        self.is_decoder = is_decoder
        self.max_relative_positions = max_relative_positions
        self.relative_positions_buckets = relative_positions_buckets
        self.attn_type = attn_type
        self.self_attn_type = self_attn_type
        self.layer_cache = (False, {"keys": torch.tensor([]), "values": torch.tensor([])})
        if relative_positions_buckets > 0:
            self.relative_attention_bias = nn.Embedding(relative_positions_buckets, head_count)
            self.relative_positions_embeddings = None
        else:
            self.relative_positions_embeddings = None
            self.relative_attention_bias = None
            if max_relative_positions == -2:  # alibi positional bias
                self.alibi = AlibiPositionalBias(head_count)
        self.flash2 = False

    def forward(self, key: Tensor, value: Tensor, query: Tensor, mask: Optional[Tensor] = None,
                sliding_window: Optional[int] = 0, step: Optional[int] = 0,
                return_attn: Optional[bool] = False) -> Tuple[Tensor, Tensor]:
        # 1) Project key, value, and query.
        # as a reminder at training layer_cache[0] remains False
        key_pad_mask = self.layer_cache[1].get("key_pad_mask", None)
        # Retrieve keys and values from linear layers (training mode).
        key = self.linear_keys(key)
        value = self.linear_values(value)
        query = self.linear_query(query)

        key = shape(key, self.dim_per_head)
        value = shape(value, self.dim_per_head)
        query = shape(query, self.dim_per_head)

        # (max_relative_positions is neither 0 nor -1 here, so the eager path below runs, as on CPU.)
        query /= sqrt(self.dim_per_head)
        # batch x num_heads x query_len x key_len
        scores = torch.matmul(query, key.transpose(2, 3))

        if self.relative_attention_bias is not None:
            q_len = key.size(2) if self.layer_cache[0] else query.size(2)
            relative_position_bucket = compute_bias(
                q_len,
                key.size(2),
                self.is_decoder,
                self.max_relative_positions,
                self.relative_positions_buckets,
                device=key.device,
            )
            values = self.relative_attention_bias(relative_position_bucket)  # shape (query_length, key_length, num_heads)
            position_bias = values.permute([2, 0, 1]).unsqueeze(0)  # shape (1, num_heads, query_length, key_length)
            if self.layer_cache[0]:
                position_bias = position_bias[:, :, -query.size(2) :, :]
            scores.add_(position_bias)

        elif self.max_relative_positions == -2:  # Alibi
            scores = self.alibi(scores)

        scores = scores.float()
        if key_pad_mask is not None and mask is None:
            mask = key_pad_mask.unsqueeze(1)

        if mask is not None:
            # not 100% necessary but expand to nb of heads
            mask = mask.expand(-1, self.head_count // self.parallel_gpu, -1, -1)
            # now mask and scores have the same shape
            scores = scores.masked_fill(mask, -1e18)

        # 3) Apply attention dropout and compute context vectors.
        attn = self.softmax(scores).to(query.dtype)
        drop_attn = self.dropout(attn) if self.dropout_p > 0 else attn

        attn_output = torch.matmul(drop_attn, value)

        context = unshape(attn_output)
        if key_pad_mask is not None:
            if key_pad_mask.size(0) > 1 and context.size(1) > 1:
                x = key_pad_mask.squeeze(1).unsqueeze(2).expand(-1, -1, context.size(2))
                context = context.masked_fill(x, 0)

        attn_output = self.final_linear(context)
        return attn_output, attn


# ---- onmt/modules/position_ffn.py ----
class PositionwiseFeedForward(nn.Module):
    def __init__(self, d_model, d_ff, dropout=0.1, add_ffnbias=True, norm_eps=1e-6):
        super(PositionwiseFeedForward, self).__init__()
        self.w_1 = nn.Linear(d_model, d_ff, bias=add_ffnbias)
        self.w_2 = nn.Linear(d_ff, d_model, bias=add_ffnbias)
        self.layer_norm = nn.LayerNorm(d_model, eps=norm_eps)
        self.dropout_p = dropout
        self.dropout_1 = nn.Dropout(dropout)
        self.dropout_2 = nn.Dropout(dropout)
        self.activation = F.relu
        self.w_3 = None

    def forward(self, x):
        norm_x = self.layer_norm(x)
        inter = self.w_1(norm_x)
        inter = self.activation(inter)
        if self.dropout_p > 0:
            inter = self.dropout_1(inter)
        inter = self.w_2(inter)
        if self.dropout_p > 0:
            inter = self.dropout_2(inter)
        return inter + x


# ---- onmt/encoders/transformer.py ----
class TransformerEncoderLayer(nn.Module):
    def __init__(self, d_model, heads, d_ff, dropout, attention_dropout, max_relative_positions=0,
                 relative_positions_buckets=0, norm_eps=1e-6):
        super(TransformerEncoderLayer, self).__init__()
        self.self_attn = MultiHeadedAttention(
            heads,
            d_model,
            dropout=attention_dropout,
            is_decoder=False,
            max_relative_positions=max_relative_positions,
            relative_positions_buckets=relative_positions_buckets,
            attn_type="self",
        )
        self.feed_forward = PositionwiseFeedForward(d_model, d_ff, dropout, norm_eps=norm_eps)
        self.parallel_residual = False
        self.layer_norm = nn.LayerNorm(d_model, eps=norm_eps)
        self.dropout_p = dropout
        self.dropout = nn.Dropout(dropout)

    def forward(self, layer_in, mask):
        """
        Args:
            layer_in (FloatTensor): ``(batch_size, src_len, model_dim)``
            mask (LongTensor): ``(batch_size, 1, src_len)``
        """
        norm_layer_in = self.layer_norm(layer_in)
        context, _ = self.self_attn(norm_layer_in, norm_layer_in, norm_layer_in, mask=mask)
        if self.dropout_p > 0:
            context = self.dropout(context)
        layer_out = context + layer_in
        layer_out = self.feed_forward(layer_out)
        return layer_out


class TransformerEncoder(nn.Module):
    def __init__(self, num_layers, d_model, heads, d_ff, dropout, attention_dropout, embeddings,
                 max_relative_positions, relative_positions_buckets, norm_eps=1e-6):
        super(TransformerEncoder, self).__init__()
        self.embeddings = embeddings
        self.transformer = nn.ModuleList(
            [
                TransformerEncoderLayer(
                    d_model,
                    heads,
                    d_ff,
                    dropout,
                    attention_dropout,
                    max_relative_positions=max_relative_positions,
                    relative_positions_buckets=relative_positions_buckets,
                    norm_eps=norm_eps,
                )
                for i in range(num_layers)
            ]
        )
        self.layer_norm = nn.LayerNorm(d_model, eps=norm_eps)

    def forward(self, src, src_len=None):
        enc_out = self.embeddings(src)
        mask = sequence_mask(src_len).unsqueeze(1).unsqueeze(1)
        mask = mask.expand(-1, -1, mask.size(3), -1)
        # Padding mask is now (batch x 1 x slen x slen)
        # 1 to be expanded to number of heads in MHA
        # Run the forward pass of every layer of the tranformer.

        for layer in self.transformer:
            enc_out = layer(enc_out, mask)
        enc_out = self.layer_norm(enc_out)
        return enc_out, None, src_len


def main():
    pad_idx, vocab, d_model, heads = 1, 50, 32, 4  # onmt's vocab puts <blank> at index 1
    # Right-padded sources as onmt's text corpus batches them (pad <blank>), with their lengths.
    sources = [[4, 17, 9, 30, 22, 8, 41, 3], [12, 5, 27], [33, 19, 7, 44, 3], [9, 3]]
    S = max(len(s) for s in sources)
    src = torch.tensor([s + [pad_idx] * (S - len(s)) for s in sources])
    src_len = torch.tensor([len(s) for s in sources])

    for name, max_rel, buckets in (("alibi", -2, 0), ("t5 buckets", 20, 16)):
        embeddings = nn.Embedding(vocab, d_model, padding_idx=pad_idx)  # Embeddings(position_encoding=False).word_lut
        encoder = TransformerEncoder(3, d_model, heads, 64, 0.1, 0.1, embeddings, max_rel, buckets).eval()
        with torch.no_grad():
            if buckets:
                for layer in encoder.transformer:
                    layer.self_attn.relative_attention_bias.weight.normal_(0.0, 1.0)
            enc_out, _, _ = encoder(src, src_len)
            for b, s in enumerate(sources):
                ref, _, _ = encoder(torch.tensor([s]), torch.tensor([len(s)]))
                err = (enc_out[b, : len(s)] - ref[0]).abs().max().item()
                assert err < 1e-5, (name, b, err)
        print(name, "padded batch matches each source alone")

    # The ALiBi bias as the module builds it, against the paper's slope_h * -|j - i|.
    alibi = AlibiPositionalBias(heads)
    got = alibi(torch.zeros(1, heads, 5, 5))[0]
    slopes = AlibiPositionalBias._get_slopes(heads)
    for h in range(heads):
        for i in range(5):
            for j in range(5):
                assert abs(got[h, i, j].item() - slopes[h] * -abs(j - i)) < 1e-6
    print("ok")


if __name__ == "__main__":
    main()
