"""vLLM HunyuanOCR vision tower: all images of a batch concatenated into one unmasked ViT sequence.

Citation: vllm-project/vllm#30344 "[Bugfix] Fix HunyuanOCR cross-image contamination in batch
processing" (opened 2025-12-09, merged; fixes vllm#30342; diagnosis in Tencent-Hunyuan/HunyuanOCR#60).
Bug: ``HunYuanVisionTransformer.forward`` embeds each image's patches ((N_i, D) per image), then
concatenates them along the patch dimension and runs every ``HunYuanVisionBlock`` over the single
sequence of sum(N_i) patches, with no mask and no cu_seqlens. Concurrent requests whose images were
batched together therefore attended to each other's patches, and OCR output of one request
contained fragments of another.
Fix (as the PR describes it): inside the layer loop, split the hidden states per image
(``torch.split`` by each image's patch count), run the block on each image alone and concatenate
the results again, so that no attention crosses an image.
Reproduction: two images of 4x6 and 2x4 patches (24 and 8 patches) in one batch, a small ViT in the
vLLM module layout (patch embed with per-image interpolated position embedding, blocks of LayerNorm
+ qkv attention through F.scaled_dot_product_attention + GELU MLP, then the per-image merger). I read
the PR description and the issue thread, not the diff; names follow the HF/vLLM HunYuanVL files.
"""
import sys
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


class HunYuanVisionPatchEmbed(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.patch_size = config.patch_size
        self.patch_embedding = nn.Linear(config.num_channels * config.patch_size ** 2, config.hidden_size)
        self.position_edge = config.max_image_size // config.patch_size
        self.position_embedding = nn.Embedding(self.position_edge ** 2, config.hidden_size)

    def forward(self, pixel_values, grid_thw):
        # pixel_values: (sum_i t*h*w, C*p*p); returns one (h*w, D) tensor per image
        patch_embeds = self.patch_embedding(pixel_values)
        pos = self.position_embedding.weight.reshape(self.position_edge, self.position_edge, -1).permute(2, 0, 1)
        out, start = [], 0
        for t, h, w in grid_thw.tolist():
            n = t * h * w
            pos_i = F.interpolate(pos[None], size=(h, w), mode="bilinear", align_corners=False)[0]
            out.append(patch_embeds[start:start + n] + pos_i.flatten(1).t().repeat(t, 1))
            start += n
        return out


class HunYuanVisionAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // self.num_heads
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size, bias=True)
        self.o_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=True)

    def forward(self, hidden_states):
        bsz, q_len, _ = hidden_states.shape
        q, k, v = self.qkv(hidden_states).chunk(3, dim=-1)
        q = q.view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        k = k.view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        v = v.view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v)
        return self.o_proj(out.transpose(1, 2).reshape(bsz, q_len, -1))


class HunYuanVisionBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.input_layernorm = nn.LayerNorm(config.hidden_size, eps=1e-5)
        self.post_attention_layernorm = nn.LayerNorm(config.hidden_size, eps=1e-5)
        self.self_attn = HunYuanVisionAttention(config)
        self.mlp = nn.Sequential(nn.Linear(config.hidden_size, config.intermediate_size), nn.GELU(),
                                 nn.Linear(config.intermediate_size, config.hidden_size))

    def forward(self, hidden_states):
        hidden_states = hidden_states + self.self_attn(self.input_layernorm(hidden_states))
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class HunYuanVisionTransformer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embeddings = HunYuanVisionPatchEmbed(config)
        self.layers = nn.ModuleList([HunYuanVisionBlock(config) for _ in range(config.num_hidden_layers)])
        self.perceive = nn.Linear(config.hidden_size, config.out_hidden_size)

    def forward(self, x, grid_thw):
        hidden_states = self.embeddings(x, grid_thw)
        split_lengths = [int(t * h * w) for t, h, w in grid_thw.tolist()]
        hidden_states = torch.cat(hidden_states, dim=0).unsqueeze(0)  # (1, sum_i N_i, D)
        for layer in self.layers:
            if FIXED:
                # process every image on its own, then put the batch back together
                per_image = torch.split(hidden_states, split_lengths, dim=1)
                hidden_states = torch.cat([layer(h) for h in per_image], dim=1)
            else:
                hidden_states = layer(hidden_states)
        hidden_states = hidden_states.squeeze(0)
        return [self.perceive(h) for h in torch.split(hidden_states, split_lengths, dim=0)]


def main():
    torch.manual_seed(0)
    config = SimpleNamespace(hidden_size=32, num_attention_heads=4, intermediate_size=64, num_hidden_layers=2,
                             patch_size=4, num_channels=3, max_image_size=32, out_hidden_size=48)
    model = HunYuanVisionTransformer(config).eval()
    grid_thw = torch.tensor([[1, 4, 6], [1, 2, 4]])  # two requests' images batched together
    pixel_values = torch.randn(int(grid_thw.prod(-1).sum()), config.num_channels * config.patch_size ** 2)
    with torch.no_grad():
        feats = model(pixel_values, grid_thw)
    print("fixed" if FIXED else "buggy", [tuple(f.shape) for f in feats],
          " ".join(f"{f.abs().mean().item():.6f}" for f in feats))


if __name__ == "__main__":
    main()
