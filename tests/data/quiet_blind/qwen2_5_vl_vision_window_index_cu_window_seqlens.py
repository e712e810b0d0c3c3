"""Qwen2.5-VL vision encoder: window attention on re-ordered patches, full attention on fullatt_block_indexes.

Follows huggingface/transformers src/transformers/models/qwen2_5_vl/modeling_qwen2_5_vl.py
(Qwen2_5_VisionTransformerPretrainedModel.get_window_index / rot_pos_emb / forward and the SDPA vision attention
that turns cu_seqlens into a block-diagonal boolean mask).  Patches of all images are concatenated into one
sequence with no batch axis.  get_window_index permutes the 2x2 merge units so that each window of
window_size // spatial_merge_size // patch_size = 4 x 4 merge units is contiguous, and cu_window_seqlens marks the
windows (empty padding windows give repeated offsets, removed by unique_consecutive).  Window layers use
cu_window_seqlens; layers in fullatt_block_indexes use cu_seqlens (one block per image, and per temporal patch
of a video: repeat_interleave(h * w, t)).  Attention is bidirectional inside a block and zero across blocks.
After the merger, argsort(window_index) restores the order.  Checked against a double loop over the patches in
their original order: same image and frame (full layers) or same image, frame and 4x4 window of merge units
(window layers).
"""
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

vision_config = SimpleNamespace(depth=4, hidden_size=32, num_heads=4, patch_size=14, spatial_merge_size=2,
                                window_size=112, fullatt_block_indexes=[1, 3], in_channels=3, out_hidden_size=24)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class VisionRotaryEmbedding(nn.Module):
    def __init__(self, dim, theta=10000.0):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (theta ** (torch.arange(0, dim, 2).float() / dim)), persistent=False)

    def forward(self, seqlen):
        return torch.outer(torch.arange(seqlen).float(), self.inv_freq)


class VisionSdpaAttention(nn.Module):
    def __init__(self, dim, num_heads):
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)

    def forward(self, hidden_states, cu_seqlens=None, position_embeddings=None, attention_mask=None):
        seq_length = hidden_states.shape[0]
        q, k, v = self.qkv(hidden_states).reshape(seq_length, 3, self.num_heads, -1).permute(1, 0, 2, 3).unbind(0)
        cos, sin = position_embeddings
        q = q * cos[:, None] + rotate_half(q) * sin[:, None]
        k = k * cos[:, None] + rotate_half(k) * sin[:, None]
        if attention_mask is None:
            attention_mask = torch.zeros([1, seq_length, seq_length], dtype=torch.bool)
            for i in range(1, len(cu_seqlens)):
                attention_mask[..., cu_seqlens[i - 1]:cu_seqlens[i], cu_seqlens[i - 1]:cu_seqlens[i]] = True
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attention_mask)
        return self.proj(out.transpose(0, 1).reshape(seq_length, -1))


class Qwen2_5_VLVisionBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.norm1, self.norm2 = nn.RMSNorm(config.hidden_size), nn.RMSNorm(config.hidden_size)
        self.attn = VisionSdpaAttention(config.hidden_size, config.num_heads)
        self.mlp = nn.Sequential(nn.Linear(config.hidden_size, 64), nn.SiLU(), nn.Linear(64, config.hidden_size))

    def forward(self, hidden_states, cu_seqlens=None, position_embeddings=None, attention_mask=None):
        hidden_states = hidden_states + self.attn(self.norm1(hidden_states), cu_seqlens, position_embeddings, attention_mask)
        return hidden_states + self.mlp(self.norm2(hidden_states))


class Qwen2_5_VisionTransformerPretrainedModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.spatial_merge_size = config.spatial_merge_size
        self.patch_size = config.patch_size
        self.fullatt_block_indexes = config.fullatt_block_indexes
        self.window_size = config.window_size
        self.spatial_merge_unit = self.spatial_merge_size * self.spatial_merge_size
        self.patch_embed = nn.Linear(config.in_channels * config.patch_size ** 2, config.hidden_size, bias=False)
        self.rotary_pos_emb = VisionRotaryEmbedding(config.hidden_size // config.num_heads // 2)
        self.blocks = nn.ModuleList(Qwen2_5_VLVisionBlock(config) for _ in range(config.depth))
        self.ln_q = nn.RMSNorm(config.hidden_size)
        hid = config.hidden_size * self.spatial_merge_unit
        self.mlp = nn.Sequential(nn.Linear(hid, hid), nn.GELU(), nn.Linear(hid, config.out_hidden_size))

    def rot_pos_emb(self, grid_thw):
        pos_ids = []
        for t, h, w in grid_thw.tolist():
            hpos_ids = torch.arange(h).unsqueeze(1).expand(-1, w)
            hpos_ids = hpos_ids.reshape(h // self.spatial_merge_size, self.spatial_merge_size,
                                        w // self.spatial_merge_size, self.spatial_merge_size).permute(0, 2, 1, 3).flatten()
            wpos_ids = torch.arange(w).unsqueeze(0).expand(h, -1)
            wpos_ids = wpos_ids.reshape(h // self.spatial_merge_size, self.spatial_merge_size,
                                        w // self.spatial_merge_size, self.spatial_merge_size).permute(0, 2, 1, 3).flatten()
            pos_ids.append(torch.stack([hpos_ids, wpos_ids], dim=-1).repeat(t, 1))
        pos_ids = torch.cat(pos_ids, dim=0)
        rotary_pos_emb_full = self.rotary_pos_emb(int(grid_thw[:, 1:].max()))
        return rotary_pos_emb_full[pos_ids].flatten(1), pos_ids

    def get_window_index(self, grid_thw):
        window_index, cu_window_seqlens, window_index_id = [], [0], 0
        vit_merger_window_size = self.window_size // self.spatial_merge_size // self.patch_size
        for grid_t, grid_h, grid_w in grid_thw.tolist():
            llm_grid_h, llm_grid_w = grid_h // self.spatial_merge_size, grid_w // self.spatial_merge_size
            index = torch.arange(grid_t * llm_grid_h * llm_grid_w).reshape(grid_t, llm_grid_h, llm_grid_w)
            pad_h = vit_merger_window_size - llm_grid_h % vit_merger_window_size
            pad_w = vit_merger_window_size - llm_grid_w % vit_merger_window_size
            num_windows_h = (llm_grid_h + pad_h) // vit_merger_window_size
            num_windows_w = (llm_grid_w + pad_w) // vit_merger_window_size
            index_padded = F.pad(index, (0, pad_w, 0, pad_h), "constant", -100)
            index_padded = index_padded.reshape(grid_t, num_windows_h, vit_merger_window_size, num_windows_w, vit_merger_window_size)
            index_padded = index_padded.permute(0, 1, 3, 2, 4).reshape(
                grid_t, num_windows_h * num_windows_w, vit_merger_window_size, vit_merger_window_size)
            seqlens = (index_padded != -100).sum([2, 3]).reshape(-1)
            index_padded = index_padded.reshape(-1)
            index_new = index_padded[index_padded != -100]
            window_index.append(index_new + window_index_id)
            cu_seqlens_tmp = seqlens.cumsum(0) * self.spatial_merge_unit + cu_window_seqlens[-1]
            cu_window_seqlens.extend(cu_seqlens_tmp.tolist())
            window_index_id += grid_t * llm_grid_h * llm_grid_w
        return torch.cat(window_index, dim=0), cu_window_seqlens

    def merger(self, x):
        return self.mlp(self.ln_q(x).view(-1, self.ln_q.normalized_shape[0] * self.spatial_merge_unit))

    def forward(self, hidden_states, grid_thw):
        hidden_states = self.patch_embed(hidden_states)
        rotary_pos_emb, _ = self.rot_pos_emb(grid_thw)
        window_index, cu_window_seqlens = self.get_window_index(grid_thw)
        cu_window_seqlens = torch.unique_consecutive(torch.tensor(cu_window_seqlens, dtype=torch.int32))
        seq_len, _ = hidden_states.size()
        hidden_states = hidden_states.reshape(seq_len // self.spatial_merge_unit, self.spatial_merge_unit, -1)
        hidden_states = hidden_states[window_index, :, :].reshape(seq_len, -1)
        rotary_pos_emb = rotary_pos_emb.reshape(seq_len // self.spatial_merge_unit, self.spatial_merge_unit, -1)
        rotary_pos_emb = rotary_pos_emb[window_index, :, :].reshape(seq_len, -1)
        emb = torch.cat((rotary_pos_emb, rotary_pos_emb), dim=-1)
        position_embeddings = (emb.cos(), emb.sin())
        cu_seqlens = torch.repeat_interleave(grid_thw[:, 1] * grid_thw[:, 2], grid_thw[:, 0]).cumsum(dim=0, dtype=torch.int32)
        cu_seqlens = F.pad(cu_seqlens, (1, 0), value=0)
        for layer_num, blk in enumerate(self.blocks):
            cu_seqlens_now = cu_seqlens if layer_num in self.fullatt_block_indexes else cu_window_seqlens
            hidden_states = blk(hidden_states, cu_seqlens=cu_seqlens_now, position_embeddings=position_embeddings)
        hidden_states = self.merger(hidden_states)
        return hidden_states[torch.argsort(window_index), :]


def reference(model, pixel_values, grid_thw):
    """Original patch order; masks from a double loop over (image, temporal patch, window of merge units)."""
    h = model.patch_embed(pixel_values)
    rotary, pos_ids = model.rot_pos_emb(grid_thw)
    emb = torch.cat((rotary, rotary), dim=-1)
    pe = (emb.cos(), emb.sin())
    image, frame = [], []
    for i, (t, gh, gw) in enumerate(grid_thw.tolist()):
        image += [i] * (t * gh * gw)
        frame += [f for f in range(t) for _ in range(gh * gw)]
    win = model.window_size // model.patch_size  # window side in patches
    n = h.size(0)
    full = torch.zeros(1, n, n, dtype=torch.bool)
    windowed = torch.zeros(1, n, n, dtype=torch.bool)
    for a in range(n):
        for b in range(n):
            if image[a] != image[b] or frame[a] != frame[b]:
                continue
            full[0, a, b] = True
            windowed[0, a, b] = bool(pos_ids[a, 0] // win == pos_ids[b, 0] // win
                                     and pos_ids[a, 1] // win == pos_ids[b, 1] // win)
    for layer_num, blk in enumerate(model.blocks):
        mask = full if layer_num in model.fullatt_block_indexes else windowed
        h = blk(h, position_embeddings=pe, attention_mask=mask)
    return model.merger(h)


def main():
    torch.manual_seed(0)
    model = Qwen2_5_VisionTransformerPretrainedModel(vision_config).eval()
    grid_thw = torch.tensor([[1, 12, 8], [1, 4, 6], [2, 2, 2]])  # two images and a 2-frame video
    n_patches = int((grid_thw[:, 0] * grid_thw[:, 1] * grid_thw[:, 2]).sum())
    pixel_values = torch.randn(n_patches, vision_config.in_channels * vision_config.patch_size ** 2)
    with torch.no_grad():
        image_embeds = model(pixel_values, grid_thw)
        torch.testing.assert_close(image_embeds, reference(model, pixel_values, grid_thw), rtol=1e-4, atol=1e-4)
    print("image_embeds", tuple(image_embeds.shape))


if __name__ == "__main__":
    main()
