# vllm-project/vllm#49815 (fixes #47864): "[Bugfix][MiMo] Apply vision attention sinks in the window attention path"
# MiMoVisionAttention allocates `self.sinks` (one learned logit per head) for every windowed ViT block, but the
# window path (`_forward_window_attn`, flash_attn_varlen_func with window_size=[w, w]) never read it, so the
# per-head sink bias the reference adds to each image's first key (logit of key 0) was loaded and dropped.
# The fix routes the window path through a kernel that adds sinks[h] to key 0 of every cu_seqlens segment.
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class VisionCfg:  # trimmed Mimo_VLVisionConfig
    depth = 3
    hidden_size = 32
    intermediate_size = 64
    out_hidden_size = 48
    num_heads = 4
    num_key_value_heads = 2
    qk_channels = 8
    kv_channels = 8
    patch_size = 2
    temporal_patch_size = 1
    in_channels = 3
    spatial_merge_size = 2
    use_sink = True
    visual_token_window_size = 3
    fullatt_block_indexes = [0]
    vit_window_attn_types = [-1, 0, 1]


def _varlen_band_attention(q, k, v, cu_seqlens, softmax_scale, window_size, sinks=None):
    """CPU stand-in for flash_attn_varlen_func(causal=False, window_size=[w, w]) over packed images.
    q: [total, Hq, D], k/v: [total, Hkv, D]. With `sinks`, adds sinks[h] to the logit of each sequence's key 0."""
    hq, hkv = q.shape[1], k.shape[1]
    out = torch.empty(q.shape[0], hq, v.shape[-1], dtype=q.dtype)
    w = window_size[0]
    for b in range(len(cu_seqlens) - 1):
        s, e = int(cu_seqlens[b]), int(cu_seqlens[b + 1])
        n = e - s
        qs = q[s:e].transpose(0, 1)  # [H, n, D]
        ks = k[s:e].transpose(0, 1).repeat_interleave(hq // hkv, dim=0)
        vs = v[s:e].transpose(0, 1).repeat_interleave(hq // hkv, dim=0)
        r = torch.arange(n)
        band = (r[:, None] - r[None, :]).abs() > w
        bias = torch.zeros(hq, n, n, dtype=q.dtype).masked_fill(band, float("-inf"))
        if sinks is not None:
            bias[:, :, 0] += sinks.view(hq, 1)
        out[s:e] = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=bias, scale=softmax_scale).transpose(0, 1)
    return out


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           softmax_scale, causal, window_size):
    assert not causal
    return _varlen_band_attention(q, k, v, cu_seqlens_q, softmax_scale, window_size)


def triton_prefill_attention(q, k, v, cu_seqlens, softmax_scale, sliding_window, sinks, sinks_bias_key0):
    assert sinks_bias_key0
    return _varlen_band_attention(q, k, v, cu_seqlens, softmax_scale, [sliding_window, sliding_window], sinks=sinks)


def full_varlen_attention(q, k, v, cu_seqlens, scale):  # MMEncoderAttention stand-in
    return _varlen_band_attention(q, k, v, cu_seqlens, scale, [10**9, 10**9])


def apply_rotary_emb(x, cos, sin):  # neox style on the first 2*cos.shape[-1] channels
    rd = cos.shape[-1] * 2
    xr, xp = x[..., :rd], x[..., rd:]
    x1, x2 = xr.chunk(2, dim=-1)
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s, xp], dim=-1)


class MiMoVisionAttention(nn.Module):
    def __init__(self, embed_dim, num_heads, num_kv_heads, qk_channels, kv_channels, use_sink=False,
                 visual_token_window_size=64):
        super().__init__()
        self.num_heads_per_partition = num_heads
        self.num_kv_heads_per_partition = num_kv_heads
        self.qk_channels = qk_channels
        self.kv_channels = kv_channels
        self.scale = qk_channels ** -0.5
        self.qkv = nn.Linear(embed_dim, num_heads * qk_channels + 2 * num_kv_heads * kv_channels, bias=True)
        self.proj = nn.Linear(num_heads * kv_channels, embed_dim, bias=True)
        # Sink attention weights: the checkpoint stores these only for non-full-attention blocks
        self.use_sink = use_sink
        if use_sink:
            self.sinks = nn.Parameter(torch.empty(num_heads), requires_grad=False)
        else:
            self.sinks = None
        self.visual_token_window_size = visual_token_window_size

    def _forward_window_attn(self, q, k, v, cu_seqlens, max_seqlen):
        w = self.visual_token_window_size
        if not FIXED:
            # before: window attention via flash_attn_varlen_func with window_size; sinks never read
            return flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens,
                                          max_seqlen_q=max_seqlen, max_seqlen_k=max_seqlen,
                                          softmax_scale=self.scale, causal=False, window_size=[w, w])
        # after: the kernel biases key 0 of each sequence by sinks[h]
        return triton_prefill_attention(q, k, v, cu_seqlens, softmax_scale=self.scale, sliding_window=w,
                                        sinks=self.sinks, sinks_bias_key0=True)

    def forward(self, x, cu_seqlens, rotary_pos_emb_cos, rotary_pos_emb_sin, max_seqlen, full_attn=True):
        qkv = self.qkv(x)  # [seq, 1, ...]
        seq_len, batch_size, _ = qkv.shape
        q_size = self.num_heads_per_partition * self.qk_channels
        kv_size = self.num_kv_heads_per_partition * self.kv_channels
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.reshape(seq_len, self.num_heads_per_partition, -1)
        k = k.reshape(seq_len, self.num_kv_heads_per_partition, -1)
        v = v.reshape(seq_len, self.num_kv_heads_per_partition, -1)
        q = apply_rotary_emb(q, rotary_pos_emb_cos, rotary_pos_emb_sin)
        k = apply_rotary_emb(k, rotary_pos_emb_cos, rotary_pos_emb_sin)
        if full_attn:
            out = full_varlen_attention(q, k, v, cu_seqlens, self.scale)
        else:
            out = self._forward_window_attn(q, k, v, cu_seqlens, max_seqlen)
        context_layer = out.reshape(seq_len, batch_size, -1)
        return self.proj(context_layer)


class MiMoVisionMLP(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden)
        self.up_proj = nn.Linear(dim, hidden)
        self.down_proj = nn.Linear(hidden, dim)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MiMoVisionBlock(nn.Module):
    def __init__(self, cfg, use_sink):
        super().__init__()
        self.norm1 = nn.RMSNorm(cfg.hidden_size, eps=1e-6)
        self.norm2 = nn.RMSNorm(cfg.hidden_size, eps=1e-6)
        self.attn = MiMoVisionAttention(cfg.hidden_size, cfg.num_heads, cfg.num_key_value_heads, cfg.qk_channels,
                                        cfg.kv_channels, use_sink=use_sink,
                                        visual_token_window_size=cfg.visual_token_window_size)
        self.mlp = MiMoVisionMLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x, cu_seqlens, rotary_pos_emb_cos, rotary_pos_emb_sin, max_seqlen, full_attn=True):
        x = x + self.attn(self.norm1(x), cu_seqlens, rotary_pos_emb_cos, rotary_pos_emb_sin, max_seqlen, full_attn)
        return x + self.mlp(self.norm2(x))


class MiMoVisionTransformer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.spatial_merge_size = cfg.spatial_merge_size
        self.spatial_merge_unit = cfg.spatial_merge_size ** 2
        self.fullatt_block_indexes = cfg.fullatt_block_indexes
        self.vit_window_attn_types = cfg.vit_window_attn_types
        self.rot_dim = cfg.qk_channels // 2
        self.patch_embed = nn.Linear(cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size ** 2,
                                     cfg.hidden_size, bias=False)
        self.blocks = nn.ModuleList([
            MiMoVisionBlock(cfg, use_sink=cfg.use_sink and i not in cfg.fullatt_block_indexes)
            for i in range(cfg.depth)])
        self.merger = nn.Sequential(nn.LayerNorm(cfg.hidden_size * 4), nn.Linear(cfg.hidden_size * 4, cfg.out_hidden_size))

    def apply_index(self, tensor, index):
        tensor = tensor.unflatten(0, (-1, self.spatial_merge_unit))
        return tensor[index].flatten(0, 1)

    def get_window_index_1d(self, grid_thw, col=True):
        window_index, window_index_id = [], 0
        for grid_t, grid_h, grid_w in grid_thw.tolist():
            lh, lw = grid_h // self.spatial_merge_size, grid_w // self.spatial_merge_size
            index = torch.arange(grid_t * lh * lw).reshape(grid_t, lh, lw)
            index_new = index.transpose(1, 2).reshape(-1) if col else index.reshape(-1)
            window_index.append(index_new + window_index_id)
            window_index_id += grid_t * lh * lw
        return torch.cat(window_index, dim=0)

    def rot_pos_emb(self, grid_thw):
        cos_list, sin_list = [], []
        inv_freq = 1.0 / (10000 ** (torch.arange(0, self.rot_dim // 2, 2).float() / (self.rot_dim // 2)))
        for t, h, w in grid_thw.tolist():
            m = self.spatial_merge_size
            hpos = torch.arange(h).unsqueeze(1).expand(-1, w).reshape(h // m, m, w // m, m).permute(0, 2, 1, 3).flatten()
            wpos = torch.arange(w).unsqueeze(0).expand(h, -1).reshape(h // m, m, w // m, m).permute(0, 2, 1, 3).flatten()
            pos_ids = torch.stack([hpos, wpos], dim=-1).repeat(t, 1)
            freqs = torch.outer(torch.arange(max(h, w)).float(), inv_freq)
            cos_list.append(freqs.cos()[pos_ids].flatten(1))
            sin_list.append(freqs.sin()[pos_ids].flatten(1))
        return torch.cat(cos_list), torch.cat(sin_list)

    def forward(self, x, grid_thw):
        x = self.patch_embed(x)
        rotary_cos, rotary_sin = self.rot_pos_emb(grid_thw)
        seqlens = torch.repeat_interleave(grid_thw[:, 1] * grid_thw[:, 2], grid_thw[:, 0])
        cu_seqlens = torch.cat([torch.tensor([0], dtype=torch.int32), seqlens.cumsum(0).to(torch.int32)])
        max_seqlen = seqlens.max()
        window_index_1d_col = self.get_window_index_1d(grid_thw, col=True)
        reverse_window_index_1d_col = torch.argsort(window_index_1d_col)
        col_cos = self.apply_index(rotary_cos, window_index_1d_col)
        col_sin = self.apply_index(rotary_sin, window_index_1d_col)
        x = x.unsqueeze(1)
        for i, blk in enumerate(self.blocks):
            t = self.vit_window_attn_types[i]
            if t == 1 and (i == 0 or self.vit_window_attn_types[i - 1] != 1):
                x = self.apply_index(x, window_index_1d_col)
            if i > 0 and t != 1 and self.vit_window_attn_types[i - 1] == 1:
                x = self.apply_index(x, reverse_window_index_1d_col)
            cos_now = col_cos if t == 1 else rotary_cos
            sin_now = col_sin if t == 1 else rotary_sin
            x = blk(x, cu_seqlens, cos_now, sin_now, max_seqlen, full_attn=i in self.fullatt_block_indexes)
        if self.vit_window_attn_types[-1] == 1:
            x = self.apply_index(x, reverse_window_index_1d_col)
        x = x.squeeze(1)
        return self.merger(x.reshape(-1, x.shape[-1] * self.spatial_merge_unit))


cfg = VisionCfg()
model = MiMoVisionTransformer(cfg).eval()
with torch.no_grad():  # load_weights: the checkpoint ships attn.sinks for the windowed blocks
    for blk in model.blocks:
        if blk.attn.sinks is not None:
            blk.attn.sinks.copy_(torch.tensor([2.0, -1.0, 3.0, 0.5]))

# two images packed into one vision call (varlen, cu_seqlens [0, 16, 40])
grid_thw = torch.tensor([[1, 4, 4], [1, 4, 6]])
n_patches = int((grid_thw.prod(-1)).sum())
pixel_values = torch.randn(n_patches, cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size ** 2)
with torch.no_grad():
    image_embeds = model(pixel_values, grid_thw)
print("fixed" if FIXED else "buggy", "image_embeds", tuple(image_embeds.shape),
      "checksum %.6f" % image_embeds.double().sum().item())
