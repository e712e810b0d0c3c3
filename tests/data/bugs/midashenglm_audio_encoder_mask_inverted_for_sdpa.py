"""vLLM MiDashengLM audio encoder: the length mask reaches SDPA inverted.

Citation: vllm-project/vllm#25925 "[Model][Bugfix] Fix MiDashengLM audio encoder mask by removing
incorrect `logical_not`" (merged; read through its description and the fixed
vllm/model_executor/models/midashenglm.py). vllm#25854 first fixed the Dasheng audio encoder's attention
with a hand-written softmax in which the mask marked the positions to *fill* (padding = True); review
replaced it by F.scaled_dot_product_attention, whose boolean ``attn_mask`` marks the keys to *keep*, but
the ``logical_not`` that turned the length mask into a padding mask stayed. Every padded audio in a batch
then attended only its padding patches (and the real patches were dropped), giving wrong embeddings.
I could not read the pre-fix diff line by line: the inversion is placed here where the encoder hands its
length mask to the blocks.

Fix: remove the inversion; ``_to_mask`` (``idx < lengths``) goes to SDPA as it is.

This program: a DashengConfig dataclass, the encoder's ``forward`` from patch embeddings (one frequency
patch row, as Dasheng's 64x4 patches give), ``x_length`` in samples scaled by ``hop_length * 4`` to patch
lengths (6 and 4 of 8 patches), the blocks calling F.scaled_dot_product_attention with
``mask[:, None, None, :]``. Buggy: each row keeps only its padded patches as keys; ``--fixed``: only
its real ones.
"""
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv


@dataclass
class DashengConfig:
    embed_dim: int = 32
    num_heads: int = 4
    depth: int = 2
    mlp_ratio: float = 4.0
    qkv_bias: bool = True
    hop_length: int = 160
    target_length: int = 32  # mel frames per split; the encoder runs target_length // 4 patches at a time


class DashengAttention(nn.Module):
    def __init__(self, dim, num_heads=8, qkv_bias=False):
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x, mask=None):
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, C // self.num_heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        x = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :] if mask is not None else None)
        x = x.transpose(1, 2).reshape(B, N, C)
        return self.proj(x)


class DashengBlock(nn.Module):
    def __init__(self, dim, num_heads, mlp_ratio=4.0, qkv_bias=False):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = DashengAttention(dim, num_heads=num_heads, qkv_bias=qkv_bias)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(dim, int(dim * mlp_ratio)), nn.GELU(), nn.Linear(int(dim * mlp_ratio), dim))

    def forward(self, x, mask=None):
        x = x + self.attn(self.norm1(x), mask)
        return x + self.mlp(self.norm2(x))


class DashengAudioTransformer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.target_length = config.target_length
        self.hop_length = config.hop_length
        self.time_pos_embed = nn.Parameter(torch.randn(1, config.embed_dim, 1, config.target_length // 4) * 0.02)
        self.freq_pos_embed = nn.Parameter(torch.randn(1, config.embed_dim, 1, 1) * 0.02)
        self.blocks = nn.ModuleList(
            DashengBlock(config.embed_dim, config.num_heads, config.mlp_ratio, config.qkv_bias)
            for _ in range(config.depth)
        )
        self.norm = nn.LayerNorm(config.embed_dim, eps=1e-6)

    def forward_features(self, x, mask=None):
        t = x.shape[-1]
        x = x + self.time_pos_embed[:, :, :, :t]
        x = x + self.freq_pos_embed[:, :, :, :]
        x = torch.permute(torch.flatten(x, 2, 3), (0, 2, 1))  # b c f t -> b (f t) c
        for block in self.blocks:
            x = block(x, mask)
        return self.norm(x)

    def _to_mask(self, lengths, max_length):
        batch_size = len(lengths)
        idx = torch.arange(max_length, device=lengths.device)
        idx = idx.repeat(batch_size).view(batch_size, max_length)
        return (idx < lengths.unsqueeze(-1)).bool()

    def forward(self, x, x_length=None):
        # x: patch embeddings (b, c, f, t), the output of the mel front end, BatchNorm and patch_embed
        t = x.shape[-1]
        target_length_in_patches = self.target_length // 4
        input_splits = x.split(target_length_in_patches, dim=-1)
        if x_length is not None:
            scaled_lengths = (x_length / (self.hop_length * 4)).long()
            mask = self._to_mask(max_length=t, lengths=scaled_lengths)
            if not FIXED:
                mask = torch.logical_not(mask)  # left from the hand-written masked_fill attention
            split_masks = mask.split(target_length_in_patches, dim=-1)
        else:
            mask = None
            split_masks = [None] * len(input_splits)
        outputs = [self.forward_features(sx, mask=sm) for sx, sm in zip(input_splits, split_masks)]
        return torch.cat(outputs, dim=1), mask


def main():
    torch.manual_seed(0)
    config = DashengConfig()
    encoder = DashengAudioTransformer(config).eval()
    patches = torch.randn(2, config.embed_dim, 1, 8)
    x_length = torch.tensor([6 * 640, 4 * 640])  # samples; 640 samples per patch (hop 160, 4 frames)
    with torch.no_grad():
        out, mask = encoder(patches, x_length)
        alone, _ = encoder(patches[1:, :, :, :4], x_length[1:])
    print("row 1 real patches match its own run:", torch.allclose(out[1, :4], alone[0], atol=1e-5))


if __name__ == "__main__":
    main()
