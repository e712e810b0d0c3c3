# huggingface/transformers#33213 (QwenLM/Qwen2-VL#38): Qwen2-VL vision tower, eager VisionAttention built its
# block-diagonal cu_seqlens mask as a bool tensor and *added* it to the scores, so patches of one image attend
# to the patches of every other image in the packed sequence.
import math
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class VisionMlp(nn.Module):
    def __init__(self, dim, hidden_dim):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden_dim)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden_dim, dim)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class VisionAttention(nn.Module):
    def __init__(self, dim, num_heads=4):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.qkv = nn.Linear(dim, dim * 3, bias=True)
        self.proj = nn.Linear(dim, dim)

    def forward(self, hidden_states, cu_seqlens):
        seq_length = hidden_states.shape[0]
        q, k, v = self.qkv(hidden_states).reshape(seq_length, 3, self.num_heads, -1).permute(1, 0, 2, 3).unbind(0)

        if FIXED:
            attention_mask = torch.full(
                [1, seq_length, seq_length], torch.finfo(q.dtype).min, device=q.device, dtype=q.dtype
            )
            for i in range(1, len(cu_seqlens)):
                attention_mask[..., cu_seqlens[i - 1] : cu_seqlens[i], cu_seqlens[i - 1] : cu_seqlens[i]] = 0
        else:
            attention_mask = torch.zeros([1, seq_length, seq_length], device=q.device, dtype=torch.bool)
            for i in range(1, len(cu_seqlens)):
                attention_mask[..., cu_seqlens[i - 1] : cu_seqlens[i], cu_seqlens[i - 1] : cu_seqlens[i]] = True

        q = q.transpose(0, 1)
        k = k.transpose(0, 1)
        v = v.transpose(0, 1)
        attn_weights = torch.matmul(q, k.transpose(1, 2)) / math.sqrt(self.head_dim)
        attn_weights = attn_weights + attention_mask
        attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(q.dtype)
        attn_output = torch.matmul(attn_weights, v)
        attn_output = attn_output.transpose(0, 1)
        attn_output = attn_output.reshape(seq_length, -1)
        return self.proj(attn_output)


class Qwen2VLVisionBlock(nn.Module):
    def __init__(self, dim, num_heads, mlp_ratio=4):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = VisionAttention(dim, num_heads=num_heads)
        self.mlp = VisionMlp(dim, dim * mlp_ratio)

    def forward(self, hidden_states, cu_seqlens):
        hidden_states = hidden_states + self.attn(self.norm1(hidden_states), cu_seqlens=cu_seqlens)
        hidden_states = hidden_states + self.mlp(self.norm2(hidden_states))
        return hidden_states


class Qwen2VisionTransformerPretrainedModel(nn.Module):
    def __init__(self, in_dim=24, embed_dim=32, depth=2, num_heads=4):
        super().__init__()
        self.patch_embed = nn.Linear(in_dim, embed_dim, bias=False)
        self.blocks = nn.ModuleList([Qwen2VLVisionBlock(embed_dim, num_heads) for _ in range(depth)])

    def forward(self, hidden_states, grid_thw):
        hidden_states = self.patch_embed(hidden_states)
        cu_seqlens = torch.repeat_interleave(grid_thw[:, 1] * grid_thw[:, 2], grid_thw[:, 0]).cumsum(
            dim=0, dtype=torch.int32
        )
        cu_seqlens = F.pad(cu_seqlens, (1, 0), value=0)
        for blk in self.blocks:
            hidden_states = blk(hidden_states, cu_seqlens=cu_seqlens)
        return hidden_states


@torch.no_grad()
def main():
    visual = Qwen2VisionTransformerPretrainedModel().eval()
    # two images in one request, patches packed into one sequence: 1x2x3 and 1x2x2 patch grids
    grid_thw = torch.tensor([[1, 2, 3], [1, 2, 2]])
    n = [int(t * h * w) for t, h, w in grid_thw.tolist()]
    pixel_values = torch.randn(sum(n), 24)

    packed = visual(pixel_values, grid_thw)
    # reference: each image encoded on its own
    ref = torch.cat(
        [visual(p, g[None]) for p, g in zip(pixel_values.split(n), grid_thw)], dim=0
    )
    diff = (packed - ref).abs().max().item()
    print(f"fixed={FIXED} max |packed - per-image| = {diff:.3e}")


if __name__ == "__main__":
    main()
