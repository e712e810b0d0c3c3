# pytorch/audio#3265: after WavLMSelfAttention moved to F.scaled_dot_product_attention, only the
# gated relative position bias went in as attn_mask; key_padding_mask was accepted but never used.
import math
import sys
from typing import Optional, Tuple

import torch
from torch import Tensor, nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class WavLMSelfAttention(nn.Module):
    def __init__(self, embed_dim, num_heads, dropout=0.0, bias=True, has_relative_attention_bias=False,
                 num_buckets=32, max_distance=128, gru_rel_pos=True):
        super().__init__()
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.has_relative_attention_bias = has_relative_attention_bias
        self.num_buckets = num_buckets
        self.max_distance = max_distance
        self.rel_attn_embed = nn.Embedding(num_buckets, num_heads) if has_relative_attention_bias else None
        self.head_dim = embed_dim // num_heads
        self.dropout = dropout
        self.attention = nn.MultiheadAttention(embed_dim, num_heads, dropout=dropout, bias=bias, batch_first=True)
        self.gru_rel_pos = gru_rel_pos
        if self.gru_rel_pos:
            self.gru_rel_pos_linear = nn.Linear(self.head_dim, 8)
            self.gru_rel_pos_const = nn.Parameter(torch.ones(1, num_heads, 1, 1))

    def compute_bias(self, query_length: int, key_length: int) -> Tensor:
        context_position = torch.arange(query_length, dtype=torch.long)[:, None]
        memory_position = torch.arange(key_length, dtype=torch.long)[None, :]
        relative_position = memory_position - context_position
        bucket = self._relative_positions_bucket(relative_position, bidirectional=True)
        return self.rel_attn_embed(bucket).permute([2, 0, 1])

    def _relative_positions_bucket(self, relative_positions: Tensor, bidirectional: bool = True):
        num_buckets = self.num_buckets
        relative_buckets = torch.zeros_like(relative_positions, dtype=torch.long)
        if bidirectional:
            num_buckets = num_buckets // 2
            relative_buckets += (relative_positions > 0).to(torch.long) * num_buckets
            relative_positions = torch.abs(relative_positions)
        max_exact = num_buckets // 2
        is_small = relative_positions < max_exact
        if_large = max_exact + (torch.log(relative_positions.float() / max_exact)
                                / math.log(self.max_distance / max_exact) * (num_buckets - max_exact)).to(torch.long)
        if_large = torch.min(if_large, torch.full_like(if_large, num_buckets - 1))
        return relative_buckets + torch.where(is_small, relative_positions, if_large)

    def forward(self, query: Tensor, key_padding_mask: Optional[Tensor] = None,
                attention_mask: Optional[Tensor] = None,
                position_bias: Optional[Tensor] = None) -> Tuple[Tensor, Optional[Tensor]]:
        bsz, seq_len, embed_dim = query.size()
        assert attention_mask is None
        if self.rel_attn_embed is not None and position_bias is None:
            position_bias = self.compute_bias(seq_len, seq_len)
            position_bias = position_bias.unsqueeze(0).repeat(bsz, 1, 1, 1)

        attn_mask_rel_pos: Optional[Tensor] = None
        if position_bias is not None:
            attn_mask_rel_pos = position_bias
            if self.gru_rel_pos:
                query_layer = query.view(bsz, seq_len, self.num_heads, -1).permute(0, 2, 1, 3)
                gate_a, gate_b = torch.sigmoid(
                    self.gru_rel_pos_linear(query_layer).view(bsz, self.num_heads, seq_len, 2, 4).sum(-1)
                ).chunk(2, dim=-1)
                gate_a_1 = gate_a * (gate_b * self.gru_rel_pos_const - 1.0) + 2.0
                attn_mask_rel_pos = gate_a_1.view(bsz, self.num_heads, -1, 1) * position_bias
            attn_mask_rel_pos = attn_mask_rel_pos.view((bsz, self.num_heads, seq_len, seq_len))

        if FIXED:
            if attn_mask_rel_pos is not None and key_padding_mask is not None:
                key_padding_mask = key_padding_mask.view(bsz, 1, 1, seq_len).expand(-1, self.num_heads, -1, -1)
                key_padding_mask = torch.nn.functional._canonical_mask(
                    mask=key_padding_mask, mask_name="key_padding_mask",
                    other_type=torch.nn.functional._none_or_dtype(attn_mask_rel_pos),
                    other_name="", target_type=query.dtype)
            if attn_mask_rel_pos is not None and key_padding_mask is not None:
                attn_mask_rel_pos = attn_mask_rel_pos + key_padding_mask

        query_projected = torch.nn.functional.linear(query, self.attention.in_proj_weight, self.attention.in_proj_bias)
        query, key, value = query_projected.chunk(3, -1)
        shape = (bsz, seq_len, self.num_heads, self.head_dim)
        query = query.view(shape).transpose(2, 1)
        key = key.view(shape).transpose(2, 1)
        value = value.view(shape).transpose(2, 1)
        dropout = self.dropout if self.training else 0.0
        attn_output = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=attn_mask_rel_pos, dropout_p=dropout, is_causal=False)
        attn_output = attn_output.transpose(1, 2).reshape(bsz, -1, self.num_heads * self.head_dim)
        return self.attention.out_proj(attn_output), position_bias


class EncoderLayer(nn.Module):
    def __init__(self, attention, d_model):
        super().__init__()
        self.attention = attention
        self.layer_norm = nn.LayerNorm(d_model)
        self.feed_forward = nn.Sequential(nn.Linear(d_model, 2 * d_model), nn.GELU(), nn.Linear(2 * d_model, d_model))
        self.final_layer_norm = nn.LayerNorm(d_model)

    def forward(self, x, attention_mask=None, position_bias=None, key_padding_mask=None):
        residual = x
        x = self.layer_norm(x)
        x, position_bias = self.attention(x, attention_mask=attention_mask, position_bias=position_bias,
                                          key_padding_mask=key_padding_mask)
        x = residual + x
        x = x + self.feed_forward(self.final_layer_norm(x))
        return x, position_bias


D, H = 32, 4
layers = nn.ModuleList([EncoderLayer(WavLMSelfAttention(D, H, has_relative_attention_bias=(i == 0)), D)
                        for i in range(2)]).eval()


def encode(x, lengths=None):
    key_padding_mask = None
    if lengths is not None:
        key_padding_mask = torch.arange(x.size(1))[None, :] >= lengths[:, None]  # True = padding frame
    position_bias = None
    for layer in layers:
        x, position_bias = layer(x, position_bias=position_bias, key_padding_mask=key_padding_mask)
    return x


# two utterances of 20 and 12 frames, padded to one batch
lengths = torch.tensor([20, 12])
feats = torch.randn(2, 20, D)
feats[1, 12:] = 0.0
with torch.no_grad():
    batched = encode(feats, lengths)
    alone = encode(feats[1:, :12])
diff = (batched[1, :12] - alone[0]).abs().max().item()
print(f"fixed={FIXED} short utterance: max |batched - alone| over real frames = {diff:.4e}")
