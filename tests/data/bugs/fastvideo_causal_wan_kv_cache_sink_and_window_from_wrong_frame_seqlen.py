# FastVideo (hao-ai-lab/FastVideo#1355, commit 63030cf): causal Wan self-forcing KV-cache rollout.
# The denoising stage read local_attn_size from transformer.model (absent -> -1, so no rolling window), and the attention
# took frame_seqlen = q.shape[1] (a whole block) for the sink and a hard-coded 1560 tokens/frame for the window.
import math
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
torch.set_default_dtype(torch.float64)

GLOBAL_ATTN_COMPAT_MAX_LATENT_FRAMES = 21


class Config:
    dim = 32
    num_heads = 2
    ffn_dim = 64
    num_layers = 2
    in_channels = 4
    patch_size = (1, 2, 2)
    local_attn_size = 4          # frames, sink included
    sink_size = 1                # frames kept at the front when rolling
    num_frames_per_block = 2
    sliding_window_num_frames = 21


# ----------------------------------------------------------------------------- rope (Wan 3-axis)
def rope_params(max_len, dim, theta=10000.0):
    freqs = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    return torch.outer(torch.arange(max_len, dtype=torch.float64), freqs)


def get_rotary_pos_embed(head_dim, f, h, w, start_frame):
    d_t = head_dim - 4 * (head_dim // 6)
    d_s = 2 * (head_dim // 6)
    ft = rope_params(1024, d_t)[start_frame:start_frame + f]
    fh = rope_params(1024, d_s)[:h]
    fw = rope_params(1024, d_s)[:w]
    ang = torch.cat([ft[:, None, None, :].expand(f, h, w, -1),
                     fh[None, :, None, :].expand(f, h, w, -1),
                     fw[None, None, :, :].expand(f, h, w, -1)], -1).reshape(f * h * w, -1)
    return ang.cos(), ang.sin()


def _apply_rotary_emb(x, cos, sin, is_neox_style=False):
    # x: [B, L, H, D], interleaved pairs
    x1, x2 = x[..., 0::2], x[..., 1::2]
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    return torch.stack([x1 * c - x2 * s, x1 * s + x2 * c], -1).flatten(-2)


class LocalAttention(nn.Module):
    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)


# ----------------------------------------------------------------------------- attention with KV cache
class CausalWanSelfAttention(nn.Module):

    def __init__(self, dim, num_heads, local_attn_size=-1, sink_size=0):
        super().__init__()
        self.dim = dim
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.local_attn_size = local_attn_size
        self.sink_size = sink_size
        if not FIXED:
            self.max_attention_size = 32760 if local_attn_size == -1 else local_attn_size * 1560
        self.attn = LocalAttention()

    def forward(self, q, k, v, freqs_cis, block_mask, kv_cache=None, current_start=0, cache_start=None,
                frame_seqlen=1560):
        if cache_start is None:
            cache_start = current_start
        cos, sin = freqs_cis
        roped_query = _apply_rotary_emb(q, cos, sin).type_as(v)
        roped_key = _apply_rotary_emb(k, cos, sin).type_as(v)

        if FIXED:
            current_end = current_start + roped_query.shape[1]
            sink_tokens = self.sink_size * frame_seqlen
            if self.local_attn_size == -1:
                max_attention_size = (GLOBAL_ATTN_COMPAT_MAX_LATENT_FRAMES * frame_seqlen)
            else:
                max_attention_size = self.local_attn_size * frame_seqlen
            if self.local_attn_size == -1 and current_end > max_attention_size:
                raise ValueError("Causal Wan local_attn_size=-1 keeps the previous 21-latent-frame KV window")
        else:
            frame_seqlen = q.shape[1]
            current_end = current_start + roped_query.shape[1]
            sink_tokens = self.sink_size * frame_seqlen
            max_attention_size = self.max_attention_size
        kv_cache_size = kv_cache["k"].shape[1]
        num_new_tokens = roped_query.shape[1]
        global_end_index = int(kv_cache["global_end_index"].item())
        local_end_index_prev = int(kv_cache["local_end_index"].item())
        if self.local_attn_size != -1 and (current_end > global_end_index) and (
                num_new_tokens + local_end_index_prev > kv_cache_size):
            num_evicted_tokens = num_new_tokens + local_end_index_prev - kv_cache_size
            num_rolled_tokens = local_end_index_prev - num_evicted_tokens - sink_tokens
            kv_cache["k"][:, sink_tokens:sink_tokens + num_rolled_tokens] = \
                kv_cache["k"][:, sink_tokens + num_evicted_tokens:sink_tokens + num_evicted_tokens + num_rolled_tokens].clone()
            kv_cache["v"][:, sink_tokens:sink_tokens + num_rolled_tokens] = \
                kv_cache["v"][:, sink_tokens + num_evicted_tokens:sink_tokens + num_evicted_tokens + num_rolled_tokens].clone()
            local_end_index = local_end_index_prev + current_end - global_end_index - num_evicted_tokens
            local_start_index = local_end_index - num_new_tokens
            kv_cache["k"][:, local_start_index:local_end_index] = roped_key
            kv_cache["v"][:, local_start_index:local_end_index] = v
        else:
            local_end_index = local_end_index_prev + current_end - global_end_index
            local_start_index = local_end_index - num_new_tokens
            kv_cache["k"] = kv_cache["k"].detach()
            kv_cache["v"] = kv_cache["v"].detach()
            kv_cache["k"][:, local_start_index:local_end_index] = roped_key
            kv_cache["v"][:, local_start_index:local_end_index] = v
        x = self.attn(
            roped_query,
            kv_cache["k"][:, max(0, local_end_index - max_attention_size):local_end_index],
            kv_cache["v"][:, max(0, local_end_index - max_attention_size):local_end_index])
        kv_cache["global_end_index"].fill_(current_end)
        kv_cache["local_end_index"].fill_(local_end_index)
        return x


class CausalWanTransformerBlock(nn.Module):

    def __init__(self, dim, ffn_dim, num_heads, local_attn_size=-1, sink_size=0):
        super().__init__()
        self.hidden_dim = dim
        self.num_attention_heads = num_heads
        self.norm1 = nn.LayerNorm(dim, 1e-6, elementwise_affine=False)
        self.to_q = nn.Linear(dim, dim)
        self.to_k = nn.Linear(dim, dim)
        self.to_v = nn.Linear(dim, dim)
        self.norm_q = nn.RMSNorm(dim, eps=1e-6)
        self.norm_k = nn.RMSNorm(dim, eps=1e-6)
        self.attn1 = CausalWanSelfAttention(dim, num_heads, local_attn_size, sink_size)
        self.to_out = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim, 1e-6, elementwise_affine=False)
        self.ffn = nn.Sequential(nn.Linear(dim, ffn_dim), nn.GELU(approximate="tanh"), nn.Linear(ffn_dim, dim))
        self.scale_shift_table = nn.Parameter(torch.randn(1, 1, 6, dim) / dim ** 0.5)

    def forward(self, hidden_states, temb, freqs_cis, block_mask=None, kv_cache=None, current_start=0,
                cache_start=None, frame_seqlen=None):
        num_frames = temb.shape[1]
        tokens_per_temb = hidden_states.shape[1] // num_frames
        if frame_seqlen is None:
            frame_seqlen = tokens_per_temb
        bs, seq_length, _ = hidden_states.shape
        e = self.scale_shift_table + temb
        shift_msa, scale_msa, gate_msa, c_shift_msa, c_scale_msa, c_gate_msa = e.chunk(6, dim=2)
        norm_hidden_states = (self.norm1(hidden_states).unflatten(1, (num_frames, tokens_per_temb)) *
                              (1 + scale_msa) + shift_msa).flatten(1, 2)
        query = self.norm_q(self.to_q(norm_hidden_states)).unflatten(2, (self.num_attention_heads, -1))
        key = self.norm_k(self.to_k(norm_hidden_states)).unflatten(2, (self.num_attention_heads, -1))
        value = self.to_v(norm_hidden_states).unflatten(2, (self.num_attention_heads, -1))
        if FIXED:
            attn_output = self.attn1(query, key, value, freqs_cis, block_mask, kv_cache, current_start, cache_start,
                                     frame_seqlen=frame_seqlen)
        else:
            attn_output = self.attn1(query, key, value, freqs_cis, block_mask, kv_cache, current_start, cache_start)
        attn_output = self.to_out(attn_output.flatten(2))
        hidden_states = hidden_states + (attn_output.unflatten(1, (num_frames, tokens_per_temb)) * gate_msa).flatten(1, 2)
        ffn_in = (self.norm2(hidden_states).unflatten(1, (num_frames, tokens_per_temb)) * (1 + c_scale_msa)
                  + c_shift_msa).flatten(1, 2)
        ff = self.ffn(ffn_in)
        return hidden_states + (ff.unflatten(1, (num_frames, tokens_per_temb)) * c_gate_msa).flatten(1, 2)


def sinusoidal(t, dim):
    half = dim // 2
    freqs = torch.exp(-math.log(10000) * torch.arange(half, dtype=torch.float64) / half)
    args = t[..., None].double() * freqs
    return torch.cat([args.cos(), args.sin()], -1)


class CausalWanTransformer3DModel(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.local_attn_size = config.local_attn_size
        self.sink_size = config.sink_size
        self.num_attention_heads = config.num_heads
        self.attention_head_dim = config.dim // config.num_heads
        self.patch_size = config.patch_size
        p = config.patch_size
        self.patch_embedding = nn.Linear(config.in_channels * p[0] * p[1] * p[2], config.dim)
        self.time_embedding = nn.Sequential(nn.Linear(config.dim, config.dim), nn.SiLU(), nn.Linear(config.dim, config.dim))
        self.time_projection = nn.Sequential(nn.SiLU(), nn.Linear(config.dim, 6 * config.dim))
        self.blocks = nn.ModuleList([
            CausalWanTransformerBlock(config.dim, config.ffn_dim, config.num_heads, config.local_attn_size,
                                      config.sink_size) for _ in range(config.num_layers)])
        self.proj_out = nn.Linear(config.dim, config.in_channels * p[0] * p[1] * p[2])

    def patchify(self, x):
        B, C, T, H, W = x.shape
        p = self.patch_size
        x = x.reshape(B, C, T, H // p[1], p[1], W // p[2], p[2]).permute(0, 2, 3, 5, 1, 4, 6)
        return x.reshape(B, T * (H // p[1]) * (W // p[2]), C * p[1] * p[2]), (T, H // p[1], W // p[2])

    def unpatchify(self, x, grid, C):
        T, h, w = grid
        p = self.patch_size
        B = x.shape[0]
        x = x.reshape(B, T, h, w, C, p[1], p[2]).permute(0, 4, 1, 2, 5, 3, 6)
        return x.reshape(B, C, T, h * p[1], w * p[2])

    def _forward_inference(self, hidden_states, timestep, kv_cache, current_start, start_frame):
        B, C = hidden_states.shape[:2]
        tokens, (T, post_patch_height, post_patch_width) = self.patchify(hidden_states)
        x = self.patch_embedding(tokens)
        temb = self.time_embedding(sinusoidal(timestep, self.config.dim))            # [B, T, D]
        timestep_proj = self.time_projection(temb).unflatten(2, (6, self.config.dim))  # [B, T, 6, D]
        freqs_cis = get_rotary_pos_embed(self.attention_head_dim, T, post_patch_height, post_patch_width, start_frame)
        for block_index, block in enumerate(self.blocks):
            kwargs = {"kv_cache": kv_cache[block_index], "current_start": current_start, "cache_start": None,
                      "block_mask": None}
            if FIXED:
                kwargs["frame_seqlen"] = post_patch_height * post_patch_width
            x = block(x, timestep_proj, freqs_cis, **kwargs)
        return self.unpatchify(self.proj_out(x), (T, post_patch_height, post_patch_width), C)

    forward = _forward_inference


# ----------------------------------------------------------------------------- denoising stage
def _get_transformer_attr(transformer, name, default):
    value = getattr(transformer, name, None)
    if value is not None:
        return value
    inner_model = getattr(transformer, "model", None)
    if inner_model is not None:
        value = getattr(inner_model, name, None)
        if value is not None:
            return value
    return default


class CausalDMDDenosingStage:

    def __init__(self, transformer, frame_seq_length):
        self.transformer = transformer
        self.num_transformer_blocks = len(transformer.blocks)
        self.num_frames_per_block = transformer.config.num_frames_per_block
        self.sliding_window_num_frames = transformer.config.sliding_window_num_frames
        if FIXED:
            self.local_attn_size = _get_transformer_attr(self.transformer, "local_attn_size", -1)
            self.sink_size = _get_transformer_attr(self.transformer, "sink_size", 0)
        else:
            try:
                self.local_attn_size = getattr(self.transformer.model, "local_attn_size", -1)
            except Exception:
                self.local_attn_size = -1
        self.frame_seq_length = frame_seq_length
        self.trace = []

    def _initialize_kv_cache(self, batch_size, dtype):
        kv_cache1 = []
        H, D = self.transformer.num_attention_heads, self.transformer.attention_head_dim
        if self.local_attn_size != -1:
            kv_cache_size = self.local_attn_size * self.frame_seq_length
        else:
            kv_cache_size = self.frame_seq_length * self.sliding_window_num_frames
        for _ in range(self.num_transformer_blocks):
            kv_cache1.append({"k": torch.zeros([batch_size, kv_cache_size, H, D], dtype=dtype),
                              "v": torch.zeros([batch_size, kv_cache_size, H, D], dtype=dtype),
                              "global_end_index": torch.tensor([0], dtype=torch.long),
                              "local_end_index": torch.tensor([0], dtype=torch.long)})
        return kv_cache1

    @torch.no_grad()
    def forward(self, latents, timesteps):
        B, C, t = latents.shape[:3]
        kv_cache1 = self._initialize_kv_cache(B, latents.dtype)
        num_blocks = t // self.num_frames_per_block
        block_sizes = [self.num_frames_per_block] * num_blocks
        start_index = 0
        for current_num_frames in block_sizes:
            current_latents = latents[:, :, start_index:start_index + current_num_frames]
            for i, t_cur in enumerate(timesteps):
                t_b = torch.full((B, current_num_frames), float(t_cur))
                pred = self.transformer(current_latents, t_b, kv_cache=kv_cache1,
                                        current_start=start_index * self.frame_seq_length, start_frame=start_index)
                self.trace.append((latents[:, :, :start_index].clone(), current_latents.clone(), t_b, pred))
                if i < len(timesteps) - 1:
                    s = timesteps[i + 1] / 1000.0
                    current_latents = (1 - s) * pred + s * torch.randn_like(pred)
            latents[:, :, start_index:start_index + current_num_frames] = pred
            # rerun with timestep zero to write the clean context into the KV cache
            t_ctx = torch.zeros((B, current_num_frames))
            self.transformer(pred, t_ctx, kv_cache=kv_cache1, current_start=start_index * self.frame_seq_length,
                             start_frame=start_index)
            start_index += current_num_frames
        return latents


# ----------------------------------------------------------------------------- reference: no cache, explicit mask
@torch.no_grad()
def reference_forward(model, context, current, t_cur, fs, nfpb, local_attn_size, sink_size):
    """Whole sequence [clean context | current block] in one pass under a block-causal sink+rolling-window mask."""
    B, C, n_ctx = context.shape[:3]
    x_all = torch.cat([context, current], 2)
    T = x_all.shape[2]
    t_all = torch.cat([torch.zeros(B, n_ctx), t_cur], 1)
    tokens, (_, hh, ww) = model.patchify(x_all)
    x = model.patch_embedding(tokens)
    proj = model.time_projection(model.time_embedding(sinusoidal(t_all, model.config.dim))).unflatten(2, (6, model.config.dim))
    cos, sin = get_rotary_pos_embed(model.attention_head_dim, T, hh, ww, 0)
    frame = torch.arange(T * fs) // fs
    block_end = (frame // nfpb + 1) * nfpb                   # first frame after the query's block
    qf, kf = block_end[:, None], frame[None, :]
    window = (kf < qf) & (kf >= qf - (local_attn_size - sink_size))
    sink = kf < sink_size
    mask = window | sink
    for blk in model.blocks:
        e = blk.scale_shift_table + proj
        sh, sc, g, csh, csc, cg = e.chunk(6, dim=2)
        n = (blk.norm1(x).unflatten(1, (T, fs)) * (1 + sc) + sh).flatten(1, 2)
        q = _apply_rotary_emb(blk.norm_q(blk.to_q(n)).unflatten(2, (blk.num_attention_heads, -1)), cos, sin)
        k = _apply_rotary_emb(blk.norm_k(blk.to_k(n)).unflatten(2, (blk.num_attention_heads, -1)), cos, sin)
        v = blk.to_v(n).unflatten(2, (blk.num_attention_heads, -1))
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           attn_mask=mask).transpose(1, 2)
        x = x + (blk.to_out(a.flatten(2)).unflatten(1, (T, fs)) * g).flatten(1, 2)
        f_in = (blk.norm2(x).unflatten(1, (T, fs)) * (1 + csc) + csh).flatten(1, 2)
        x = x + (blk.ffn(f_in).unflatten(1, (T, fs)) * cg).flatten(1, 2)
    out = model.unpatchify(model.proj_out(x), (T, hh, ww), C)
    return out[:, :, n_ctx:]


cfg = Config()
model = CausalWanTransformer3DModel(cfg).eval()
B, T_lat, H_lat, W_lat = 2, 8, 4, 4
frame_seq_length = (H_lat // 2) * (W_lat // 2)      # 4 tokens per latent frame, 32 tokens in all
stage = CausalDMDDenosingStage(model, frame_seq_length)
latents = torch.randn(B, cfg.in_channels, T_lat, H_lat, W_lat)
stage.forward(latents, timesteps=[1000, 500])

worst = 0.0
for context, current, t_b, pred in stage.trace:
    ref = reference_forward(model, context, current, t_b, frame_seq_length, cfg.num_frames_per_block,
                            cfg.local_attn_size, cfg.sink_size)
    worst = max(worst, (pred - ref).abs().max().item())
print(f"stage local_attn_size={stage.local_attn_size}; "
      f"max |KV-cache rollout - sink+window masked reference| = {worst:.3e}")
