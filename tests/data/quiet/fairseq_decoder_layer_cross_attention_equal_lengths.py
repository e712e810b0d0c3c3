# Follows fairseq's fairseq/modules/transformer_layer.py TransformerDecoderLayer and multihead_attention.py
# MultiheadAttention (time-major (T, B, C), scores (B * heads, T, S)): the layer is handed the decoder's future mask
# `self_attn_mask` (additive, -inf above the diagonal, as TransformerDecoder.buffered_future_mask builds it) and the
# source's `encoder_padding_mask`; its encoder_attn is called with key_padding_mask=encoder_padding_mask and no
# attn_mask. The sources here are not padded (encoder_padding_mask None, as fairseq passes it when no source token is
# a pad), and each target has as many tokens as its source (5). Checked against each sentence alone, one query at a
# time over the targets before it.
import math

import torch
import torch.nn.functional as F

torch.manual_seed(0)
torch.set_default_dtype(torch.float64)


class MultiheadAttention(torch.nn.Module):
    def __init__(self, embed_dim, num_heads):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, embed_dim // num_heads
        self.scaling = self.head_dim ** -0.5
        self.k_proj = torch.nn.Linear(embed_dim, embed_dim)
        self.v_proj = torch.nn.Linear(embed_dim, embed_dim)
        self.q_proj = torch.nn.Linear(embed_dim, embed_dim)
        self.out_proj = torch.nn.Linear(embed_dim, embed_dim)

    def forward(self, query, key, value, key_padding_mask=None, attn_mask=None):
        tgt_len, bsz, embed_dim = query.size()
        q = self.q_proj(query) * self.scaling
        k, v = self.k_proj(key), self.v_proj(value)
        q = q.contiguous().view(tgt_len, bsz * self.num_heads, self.head_dim).transpose(0, 1)
        k = k.contiguous().view(-1, bsz * self.num_heads, self.head_dim).transpose(0, 1)
        v = v.contiguous().view(-1, bsz * self.num_heads, self.head_dim).transpose(0, 1)
        src_len = k.size(1)
        attn_weights = torch.bmm(q, k.transpose(1, 2))
        if attn_mask is not None:
            attn_weights += attn_mask.unsqueeze(0)
        if key_padding_mask is not None:
            attn_weights = attn_weights.view(bsz, self.num_heads, tgt_len, src_len)
            attn_weights = attn_weights.masked_fill(key_padding_mask.unsqueeze(1).unsqueeze(2).bool(), float("-inf"))
            attn_weights = attn_weights.view(bsz * self.num_heads, tgt_len, src_len)
        attn_probs = F.softmax(attn_weights, dim=-1)
        attn = torch.bmm(attn_probs, v).transpose(0, 1).contiguous().view(tgt_len, bsz, embed_dim)
        return self.out_proj(attn), attn_probs


class TransformerDecoderLayer(torch.nn.Module):
    def __init__(self, embed_dim, heads):
        super().__init__()
        self.self_attn = MultiheadAttention(embed_dim, heads)
        self.encoder_attn = MultiheadAttention(embed_dim, heads)
        self.self_attn_layer_norm = torch.nn.LayerNorm(embed_dim)
        self.encoder_attn_layer_norm = torch.nn.LayerNorm(embed_dim)

    def forward(self, x, encoder_out=None, encoder_padding_mask=None, self_attn_mask=None, self_attn_padding_mask=None):
        residual = x
        x, _ = self.self_attn(query=x, key=x, value=x, key_padding_mask=self_attn_padding_mask, attn_mask=self_attn_mask)
        x = self.self_attn_layer_norm(residual + x)
        residual = x
        x, attn = self.encoder_attn(query=x, key=encoder_out, value=encoder_out, key_padding_mask=encoder_padding_mask)
        return self.encoder_attn_layer_norm(residual + x), attn


embed_dim, heads, tgt_len, src_len, bsz = 16, 2, 5, 5, 3
layers = torch.nn.ModuleList([TransformerDecoderLayer(embed_dim, heads) for _ in range(2)])


def buffered_future_mask(tensor):
    dim = tensor.size(0)
    return torch.triu(torch.zeros(dim, dim).fill_(float("-inf")), 1)


def decode(x, encoder_out):
    self_attn_mask = buffered_future_mask(x)
    for layer in layers:
        x, _ = layer(x, encoder_out, None, self_attn_mask=self_attn_mask)
    return x


x, encoder_out = torch.randn(tgt_len, bsz, embed_dim), torch.randn(src_len, bsz, embed_dim)
def last_alone(layer, prefix, memory):
    """The layer's output at the prefix's last target, from that one query over the prefix: no later key exists."""
    y, _ = layer.self_attn(query=prefix[-1:], key=prefix, value=prefix)
    y = layer.self_attn_layer_norm(prefix[-1:] + y)
    z, _ = layer.encoder_attn(query=y, key=memory, value=memory)
    return layer.encoder_attn_layer_norm(y + z)


with torch.no_grad():
    out = decode(x, encoder_out)
    diff = 0.0
    for b in range(bsz):  # the reference: each sentence alone, layer by layer, target t from targets 0..t only
        y = x[:, b : b + 1]
        for layer in layers:
            y = torch.cat([last_alone(layer, y[: t + 1], encoder_out[:, b : b + 1]) for t in range(tgt_len)])
        diff = max(diff, (out[:, b] - y[:, 0]).abs().max().item())
print(f"max abs diff (batched decoder vs each prefix alone): {diff:.3e}")
assert not math.isnan(diff) and diff < 1e-12
