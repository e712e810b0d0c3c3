# facebookresearch/fairseq#1682 (see #1339): TransformerEncoderLayer.forward accepted attn_mask and converted it,
# but never passed it to self.self_attn, so the requested (here: unidirectional) encoder mask was silently dropped.
import sys
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

FIXED = "--fixed" in sys.argv


class MultiheadAttention(nn.Module):
    def __init__(self, embed_dim, num_heads, self_attention=False):
        super().__init__()
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.scaling = self.head_dim ** -0.5
        self.self_attention = self_attention
        self.k_proj = nn.Linear(embed_dim, embed_dim)
        self.v_proj = nn.Linear(embed_dim, embed_dim)
        self.q_proj = nn.Linear(embed_dim, embed_dim)
        self.out_proj = nn.Linear(embed_dim, embed_dim)

    def forward(self, query, key, value, key_padding_mask: Optional[Tensor] = None,
                need_weights: bool = True, attn_mask: Optional[Tensor] = None):
        tgt_len, bsz, embed_dim = query.size()
        q = self.q_proj(query) * self.scaling
        k = self.k_proj(key)
        v = self.v_proj(value)
        q = q.contiguous().view(tgt_len, bsz * self.num_heads, self.head_dim).transpose(0, 1)
        k = k.contiguous().view(-1, bsz * self.num_heads, self.head_dim).transpose(0, 1)
        v = v.contiguous().view(-1, bsz * self.num_heads, self.head_dim).transpose(0, 1)
        src_len = k.size(1)

        attn_weights = torch.bmm(q, k.transpose(1, 2))
        if attn_mask is not None:
            attn_mask = attn_mask.unsqueeze(0)
            attn_weights += attn_mask
        if key_padding_mask is not None:
            attn_weights = attn_weights.view(bsz, self.num_heads, tgt_len, src_len)
            attn_weights = attn_weights.masked_fill(
                key_padding_mask.unsqueeze(1).unsqueeze(2).to(torch.bool), float("-inf"))
            attn_weights = attn_weights.view(bsz * self.num_heads, tgt_len, src_len)
        attn_probs = F.softmax(attn_weights, dim=-1)
        attn = torch.bmm(attn_probs, v)
        attn = attn.transpose(0, 1).contiguous().view(tgt_len, bsz, embed_dim)
        return self.out_proj(attn), None


class TransformerEncoderLayer(nn.Module):
    def __init__(self, embed_dim=32, heads=4, ffn_dim=64):
        super().__init__()
        self.self_attn = MultiheadAttention(embed_dim, heads, self_attention=True)
        self.self_attn_layer_norm = nn.LayerNorm(embed_dim)
        self.fc1 = nn.Linear(embed_dim, ffn_dim)
        self.fc2 = nn.Linear(ffn_dim, embed_dim)
        self.final_layer_norm = nn.LayerNorm(embed_dim)

    def forward(self, x, encoder_padding_mask, attn_mask: Optional[Tensor] = None):
        """
        attn_mask (ByteTensor): binary tensor of shape (T_tgt, T_src); attn_mask[t_tgt, t_src] = 1 means
            t_src is excluded (masked out) when computing the embedding for t_tgt.
        """
        residual = x
        if attn_mask is not None:
            attn_mask = attn_mask.masked_fill(attn_mask.to(torch.bool), -1e8)
        if FIXED:
            x, _ = self.self_attn(query=x, key=x, value=x, key_padding_mask=encoder_padding_mask,
                                  attn_mask=attn_mask)
        else:
            x, _ = self.self_attn(query=x, key=x, value=x, key_padding_mask=encoder_padding_mask)
        x = self.self_attn_layer_norm(residual + x)
        residual = x
        x = self.fc2(F.relu(self.fc1(x)))
        return self.final_layer_norm(residual + x)


class UnidirectionalEncoder(nn.Module):
    """A left-to-right encoder (e.g. for streaming), masking future source positions in every layer."""

    def __init__(self, vocab=40, embed_dim=32, layers=2, padding_idx=1):
        super().__init__()
        self.padding_idx = padding_idx
        self.embed_tokens = nn.Embedding(vocab, embed_dim, padding_idx=padding_idx)
        self.layers = nn.ModuleList([TransformerEncoderLayer(embed_dim) for _ in range(layers)])

    def buffered_future_mask(self, tensor):
        dim = tensor.size(0)
        return torch.triu(torch.ones(dim, dim), 1)

    def forward(self, src_tokens):
        x = self.embed_tokens(src_tokens).transpose(0, 1)  # B x T x C -> T x B x C
        encoder_padding_mask = src_tokens.eq(self.padding_idx)
        future_mask = self.buffered_future_mask(x)
        for layer in self.layers:
            x = layer(x, encoder_padding_mask, attn_mask=future_mask)
        return x.transpose(0, 1)


def main():
    torch.manual_seed(0)
    enc = UnidirectionalEncoder().eval()
    src_tokens = torch.randint(2, 40, (2, 6))
    src_tokens[1, 4:] = 1  # right padding
    with torch.no_grad():
        full = enc(src_tokens)
        prefix = enc(src_tokens[:, :3])
    print("max |encoder(prefix) - encoder(full)[:, :3]| =", (prefix - full[:, :3]).abs().max().item())


if __name__ == "__main__":
    main()
