# facebookresearch/fairseq commit 8ad9f316 ("Fix bug on generating encoder mask"): speech_to_text
# lengths_to_encoder_padding_mask compared arange(0..T-1) > lengths, so the first padded frame stayed unmasked.
import math
import sys
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

FIXED = "--fixed" in sys.argv


def lengths_to_encoder_padding_mask(lengths, batch_first: bool = False):
    """
    Return: encoder_padding_mask, a (max_length, B) binary mask where
        [t, b] = False for t < lengths[b] and True otherwise
    """
    max_lengths = torch.max(lengths).item()
    bsz = lengths.size(0)
    if FIXED:
        positions = torch.arange(start=1, end=max_lengths + 1)
    else:
        positions = torch.arange(max_lengths)  # a (T, ) tensor with [0, ..., T-1]
    encoder_padding_mask = positions.to(lengths.device).view(1, max_lengths).expand(
        bsz, -1) > lengths.view(bsz, 1).expand(-1, max_lengths)
    if not batch_first:
        return encoder_padding_mask.t(), max_lengths
    else:
        return encoder_padding_mask, max_lengths


class MultiheadAttention(nn.Module):
    def __init__(self, embed_dim, num_heads):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.scaling = self.head_dim ** -0.5
        self.k_proj = nn.Linear(embed_dim, embed_dim)
        self.v_proj = nn.Linear(embed_dim, embed_dim)
        self.q_proj = nn.Linear(embed_dim, embed_dim)
        self.out_proj = nn.Linear(embed_dim, embed_dim)

    def forward(self, query, key, value, key_padding_mask: Optional[Tensor] = None):
        tgt_len, bsz, embed_dim = query.size()
        q = (self.q_proj(query) * self.scaling).view(tgt_len, bsz * self.num_heads, self.head_dim).transpose(0, 1)
        k = self.k_proj(key).view(-1, bsz * self.num_heads, self.head_dim).transpose(0, 1)
        v = self.v_proj(value).view(-1, bsz * self.num_heads, self.head_dim).transpose(0, 1)
        src_len = k.size(1)
        attn_weights = torch.bmm(q, k.transpose(1, 2))
        if key_padding_mask is not None:
            attn_weights = attn_weights.view(bsz, self.num_heads, tgt_len, src_len)
            attn_weights = attn_weights.masked_fill(key_padding_mask.unsqueeze(1).unsqueeze(2), float("-inf"))
            attn_weights = attn_weights.view(bsz * self.num_heads, tgt_len, src_len)
        attn = torch.bmm(F.softmax(attn_weights, dim=-1), v)
        return self.out_proj(attn.transpose(0, 1).contiguous().view(tgt_len, bsz, embed_dim)), None


class TransformerEncoderLayer(nn.Module):
    def __init__(self, embed_dim, heads, ffn_dim):
        super().__init__()
        self.self_attn = MultiheadAttention(embed_dim, heads)
        self.self_attn_layer_norm = nn.LayerNorm(embed_dim)
        self.fc1 = nn.Linear(embed_dim, ffn_dim)
        self.fc2 = nn.Linear(ffn_dim, embed_dim)
        self.final_layer_norm = nn.LayerNorm(embed_dim)

    def forward(self, x, encoder_padding_mask):
        residual = x
        x, _ = self.self_attn(query=x, key=x, value=x, key_padding_mask=encoder_padding_mask)
        x = self.self_attn_layer_norm(residual + x)
        residual = x
        return self.final_layer_norm(residual + self.fc2(F.relu(self.fc1(x))))


class ConvTransformerEncoder(nn.Module):
    """Conv front-end (stride 2) followed by Transformer layers, as in speech_to_text/convtransformer.py."""

    def __init__(self, input_feat_per_channel=8, embed_dim=16, layers=2, heads=2):
        super().__init__()
        self.conv = nn.Conv1d(input_feat_per_channel, embed_dim, kernel_size=3, stride=2, padding=1)
        self.embed_scale = math.sqrt(embed_dim)
        self.transformer_layers = nn.ModuleList(
            [TransformerEncoderLayer(embed_dim, heads, 32) for _ in range(layers)])

    def forward(self, src_tokens, src_lengths):
        # src_tokens: B x T x C (filterbank features)
        x = F.relu(self.conv(src_tokens.transpose(1, 2)))  # B x C x T'
        x = x.permute(2, 0, 1) * self.embed_scale  # T' x B x C
        input_lengths = torch.div(src_lengths - 1, 2, rounding_mode="floor") + 1
        encoder_padding_mask, _ = lengths_to_encoder_padding_mask(input_lengths, batch_first=True)
        for layer in self.transformer_layers:
            x = layer(x, encoder_padding_mask)
        return {"encoder_out": x, "encoder_padding_mask": encoder_padding_mask, "lengths": input_lengths}


def main():
    torch.manual_seed(0)
    enc = ConvTransformerEncoder().eval()
    feats = torch.randn(2, 20, 8)
    src_lengths = torch.tensor([20, 12])
    feats[1, 12:] = 0.0  # zero-padded filterbanks
    with torch.no_grad():
        batched = enc(feats, src_lengths)
        alone = enc(feats[1:, :12], src_lengths[1:])
    n = int(alone["lengths"][0])
    print("padding mask row of the short utterance:", batched["encoder_padding_mask"][1].int().tolist())
    print("max |enc(short, batched) - enc(short, alone)| =",
          (batched["encoder_out"][:n, 1] - alone["encoder_out"][:, 0]).abs().max().item())


if __name__ == "__main__":
    main()
