# Citation: huggingface/transformers v4.45.0 src/transformers/models/qwen2_vl/modeling_qwen2_vl.py
#   (Qwen2VisionTransformerPretrainedModel.forward building cu_seqlens from grid_thw, VisionSdpaAttention,
#   apply_rotary_pos_emb_vision, VisionRotaryEmbedding, rot_pos_emb).
# Patches of all images/video frames are packed into one sequence with no batch dim. cu_seqlens =
# repeat_interleave(h*w, t).cumsum padded with 0, so each frame is one block; VisionSdpaAttention turns it into a
# bool keep mask (zeros, then True on each diagonal block) for SDPA: patches attend only inside their own frame.
import torch
import torch.nn.functional as F
from torch import nn

torch.manual_seed(0)


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb_vision(tensor, freqs):
    orig_dtype = tensor.dtype
    tensor = tensor.float()
    cos = freqs.cos()
    sin = freqs.sin()
    cos = cos.unsqueeze(1).repeat(1, 1, 2).unsqueeze(0).float()
    sin = sin.unsqueeze(1).repeat(1, 1, 2).unsqueeze(0).float()
    output = (tensor * cos) + (rotate_half(tensor) * sin)
    return output.to(orig_dtype)


class VisionRotaryEmbedding(nn.Module):
    def __init__(self, dim, theta=10000.0):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, seqlen):
        seq = torch.arange(seqlen, device=self.inv_freq.device, dtype=self.inv_freq.dtype)
        return torch.outer(seq, self.inv_freq)


class VisionSdpaAttention(nn.Module):
    def __init__(self, dim, num_heads=16):
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, dim * 3, bias=True)
        self.proj = nn.Linear(dim, dim)

    def forward(self, hidden_states, cu_seqlens, rotary_pos_emb=None):
        seq_length = hidden_states.shape[0]
        q, k, v = self.qkv(hidden_states).reshape(seq_length, 3, self.num_heads, -1).permute(1, 0, 2, 3).unbind(0)
        q = apply_rotary_pos_emb_vision(q.unsqueeze(0), rotary_pos_emb).squeeze(0)
        k = apply_rotary_pos_emb_vision(k.unsqueeze(0), rotary_pos_emb).squeeze(0)
        attention_mask = torch.zeros([1, seq_length, seq_length], device=q.device, dtype=torch.bool)
        for i in range(1, len(cu_seqlens)):
            attention_mask[..., cu_seqlens[i - 1]: cu_seqlens[i], cu_seqlens[i - 1]: cu_seqlens[i]] = True
        q = q.transpose(0, 1)
        k = k.transpose(0, 1)
        v = v.transpose(0, 1)
        attn_output = F.scaled_dot_product_attention(q, k, v, attention_mask, dropout_p=0.0)
        attn_output = attn_output.transpose(0, 1)
        attn_output = attn_output.reshape(seq_length, -1)
        return self.proj(attn_output)


class Qwen2VLVisionBlock(nn.Module):
    def __init__(self, dim, num_heads):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim, eps=1e-6), nn.LayerNorm(dim, eps=1e-6)
        self.attn = VisionSdpaAttention(dim, num_heads=num_heads)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(approximate="tanh"), nn.Linear(2 * dim, dim))

    def forward(self, hidden_states, cu_seqlens, rotary_pos_emb):
        hidden_states = hidden_states + self.attn(self.norm1(hidden_states), cu_seqlens=cu_seqlens, rotary_pos_emb=rotary_pos_emb)
        return hidden_states + self.mlp(self.norm2(hidden_states))


class Qwen2VisionTransformer(nn.Module):
    def __init__(self, embed_dim=32, num_heads=4, depth=2, patch_dim=24, spatial_merge_size=2):
        super().__init__()
        self.spatial_merge_size = spatial_merge_size
        self.patch_embed = nn.Linear(patch_dim, embed_dim, bias=False)
        head_dim = embed_dim // num_heads
        self.rotary_pos_emb = VisionRotaryEmbedding(head_dim // 2)
        self.blocks = nn.ModuleList([Qwen2VLVisionBlock(embed_dim, num_heads) for _ in range(depth)])

    def rot_pos_emb(self, grid_thw):
        pos_ids = []
        for t, h, w in grid_thw:
            hpos_ids = torch.arange(h).unsqueeze(1).expand(-1, w)
            hpos_ids = hpos_ids.reshape(h // self.spatial_merge_size, self.spatial_merge_size,
                                        w // self.spatial_merge_size, self.spatial_merge_size)
            hpos_ids = hpos_ids.permute(0, 2, 1, 3).flatten()
            wpos_ids = torch.arange(w).unsqueeze(0).expand(h, -1)
            wpos_ids = wpos_ids.reshape(h // self.spatial_merge_size, self.spatial_merge_size,
                                        w // self.spatial_merge_size, self.spatial_merge_size)
            wpos_ids = wpos_ids.permute(0, 2, 1, 3).flatten()
            pos_ids.append(torch.stack([hpos_ids, wpos_ids], dim=-1).repeat(t, 1))
        pos_ids = torch.cat(pos_ids, dim=0)
        max_grid_size = grid_thw[:, 1:].max()
        rotary_pos_emb_full = self.rotary_pos_emb(max_grid_size)
        rotary_pos_emb = rotary_pos_emb_full[pos_ids].flatten(1)
        return rotary_pos_emb

    def forward(self, hidden_states, grid_thw):
        hidden_states = self.patch_embed(hidden_states)
        rotary_pos_emb = self.rot_pos_emb(grid_thw)
        cu_seqlens = torch.repeat_interleave(grid_thw[:, 1] * grid_thw[:, 2], grid_thw[:, 0]).cumsum(
            dim=0, dtype=torch.int32)
        cu_seqlens = F.pad(cu_seqlens, (1, 0), value=0)
        for blk in self.blocks:
            hidden_states = blk(hidden_states, cu_seqlens=cu_seqlens, rotary_pos_emb=rotary_pos_emb)
        return hidden_states, cu_seqlens


# one image 4x6 patches, one 2-frame video of 2x4 patches, one image 2x2 patches
grid_thw = torch.tensor([[1, 4, 6], [2, 2, 4], [1, 2, 2]])
n = int((grid_thw.prod(-1)).sum())
model = Qwen2VisionTransformer()
pixel_values = torch.randn(n, 24)
out, cu_seqlens = model(pixel_values, grid_thw)
# every frame gives the same output when run alone
with torch.no_grad():
    alone, _ = model(pixel_values[:24], grid_thw[:1])
assert torch.allclose(alone, out[:24], atol=1e-5)
loss = out.pow(2).mean()
loss.backward()
print("cu_seqlens", cu_seqlens.tolist(), "out norm %.4f" % out.norm().item())
