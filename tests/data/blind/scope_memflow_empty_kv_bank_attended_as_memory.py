# daydreamlive/scope commit 8195114 ("Only use kv bank if populated in memflow"). Scope's MemFlow pipeline
# (streaming long-video generation on Wan2.1, frame blocks of 3 latent frames) attends, for each new block, to
# [sink frames | memory bank | local window] of its KV cache. The memory bank is a second per-layer cache whose slots
# are only filled when the bank is recorded; until then it holds zeros and its global_end_index stays 0. But the
# bank slice taken in CausalWanSelfAttention was bank_k[:, :local_end_index_bank_], with local_end_index_bank_
# computed from the block position alone (one frame's worth of tokens on a block that is not a record block), so the
# new block's queries attended to a frame of all-zero keys/values that stand for no real frame (the commit: "On first
# frames, the bank is zeros which causes noisy output"). Fix: take the bank only when
# kv_bank["global_end_index"] > 0, else an empty slice.
# (Trimmed torch port of src/scope/core/pipelines/memflow/modules/causal_model.py: the cache path of
# CausalWanSelfAttention with its direct-insert update and _apply_cache_updates, causal 3-D RoPE, the wan2_1
# `attention` fallback (SDPA, no mask); tiny dims, two blocks, latents given as tokens.)
import math
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv

torch.manual_seed(0)


def attention(q, k, v):
    # scope.core.pipelines.wan2_1.modules.attention.attention without flash-attn: SDPA over [B, L, N, D]
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    return out.transpose(1, 2).contiguous()


def rope_params(max_seq_len, dim, theta=10000):
    assert dim % 2 == 0
    freqs = torch.outer(
        torch.arange(max_seq_len), 1.0 / torch.pow(theta, torch.arange(0, dim, 2).to(torch.float64).div(dim))
    )
    freqs = torch.polar(torch.ones_like(freqs), freqs)
    return freqs


def causal_rope_apply(x, grid_sizes, freqs, start_frame=0):
    n, c = x.size(2), x.size(3) // 2
    freqs = freqs.split([c - 2 * (c // 3), c // 3, c // 3], dim=1)
    output = []
    for i, (f, h, w) in enumerate(grid_sizes.tolist()):
        seq_len = f * h * w
        x_i = torch.view_as_complex(x[i, :seq_len].to(torch.float64).reshape(seq_len, n, -1, 2))
        freqs_i = torch.cat(
            [
                freqs[0][start_frame : start_frame + f].view(f, 1, 1, -1).expand(f, h, w, -1),
                freqs[1][:h].view(1, h, 1, -1).expand(f, h, w, -1),
                freqs[2][:w].view(1, 1, w, -1).expand(f, h, w, -1),
            ],
            dim=-1,
        ).reshape(seq_len, 1, -1)
        x_i = torch.view_as_real(x_i * freqs_i).flatten(2)
        x_i = torch.cat([x_i, x[i, seq_len:]])
        output.append(x_i)
    return torch.stack(output).type_as(x)


class WanRMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + self.eps) * self.weight


class CausalWanSelfAttention(nn.Module):
    def __init__(self, dim, num_heads, local_attn_size=-1, sink_size=0, qk_norm=True, eps=1e-6,
                 record_interval=3, SMA=False):
        super().__init__()
        self.dim = dim
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.local_attn_size = local_attn_size
        self.sink_size = sink_size
        self.record_interval = record_interval
        self.SMA = SMA
        self.frame_seq_length = None
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, dim)
        self.v = nn.Linear(dim, dim)
        self.o = nn.Linear(dim, dim)
        self.norm_q = WanRMSNorm(dim, eps=eps) if qk_norm else nn.Identity()
        self.norm_k = WanRMSNorm(dim, eps=eps) if qk_norm else nn.Identity()

    def forward(self, x, grid_sizes, freqs, kv_cache=None, current_start=0, kv_bank=None, is_recache=False):
        b, s, n, d = *x.shape[:2], self.num_heads, self.head_dim
        q = self.norm_q(self.q(x)).view(b, s, n, d)
        k = self.norm_k(self.k(x)).view(b, s, n, d)
        v = self.v(x).view(b, s, n, d)

        frame_seqlen = math.prod(grid_sizes[0][1:]).item()
        self.max_attention_size = self.local_attn_size * frame_seqlen
        current_start_frame = current_start // frame_seqlen
        roped_query = causal_rope_apply(q, grid_sizes, freqs, start_frame=current_start_frame).type_as(v)
        roped_key = causal_rope_apply(k, grid_sizes, freqs, start_frame=current_start_frame).type_as(v)

        current_end = current_start + roped_query.shape[1]
        current_end_bank = ((current_end // (frame_seqlen * 3) - 1) // self.record_interval + 1) * frame_seqlen
        sink_tokens = self.sink_size * frame_seqlen
        kv_bank_size = kv_bank["k"].shape[1]
        num_new_tokens = roped_query.shape[1]
        is_recompute = current_end <= kv_cache["global_end_index"].item() and current_start > 0

        # Assign new keys/values directly up to current_end (no eviction in this short stream)
        local_end_index = kv_cache["local_end_index"].item() + current_end - kv_cache["global_end_index"].item()
        local_start_index = local_end_index - num_new_tokens
        temp_k = kv_cache["k"].clone()
        temp_v = kv_cache["v"].clone()

        local_end_index_bank = (
            kv_bank["local_end_index"].item() + current_end_bank - kv_bank["global_end_index"].item()
        )
        local_start_index_bank = local_end_index_bank - num_new_tokens // 3
        bank_k = kv_bank["k"].clone()
        bank_v = kv_bank["v"].clone()
        write_start_index = max(local_start_index, sink_tokens) if is_recompute else local_start_index
        roped_offset = max(0, write_start_index - local_start_index)
        write_len = max(0, local_end_index - write_start_index)
        if write_len > 0:
            temp_k[:, write_start_index:local_end_index] = roped_key[:, roped_offset : roped_offset + write_len]
            temp_v[:, write_start_index:local_end_index] = v[:, roped_offset : roped_offset + write_len]
        cache_update_info = {
            "action": "direct_insert",
            "local_end_index": local_end_index,
            "local_end_index_bank": local_end_index_bank,
            "write_start_index": write_start_index,
            "write_end_index": local_end_index,
            "new_k": roped_key[:, roped_offset : roped_offset + write_len],
            "new_v": v[:, roped_offset : roped_offset + write_len],
            "current_end_bank": current_end_bank,
            "is_recompute": is_recompute,
            "frame_seqlen": frame_seqlen,
        }

        # Concatenate sink tokens, memory bank and local window tokens
        local_budget = self.max_attention_size - sink_tokens
        k_sink = temp_k[:, :sink_tokens]
        v_sink = temp_v[:, :sink_tokens]
        local_start_for_window = max(sink_tokens, local_end_index - local_budget)
        k_local = temp_k[:, local_start_for_window:local_end_index]
        v_local = temp_v[:, local_start_for_window:local_end_index]

        if not is_recache:
            is_update_bank = (current_start // (3 * frame_seqlen)) % self.record_interval == 0
        else:
            is_update_bank = False
        if is_update_bank:
            local_end_index_bank_ = min(local_start_index_bank, kv_bank_size)
        else:
            local_end_index_bank_ = min(local_end_index_bank, kv_bank_size)

        if FIXED:
            # Only use the bank if it has been populated with real data
            bank_has_data = kv_bank["global_end_index"].item() > 0
            if bank_has_data:
                k_bank = bank_k[:, :local_end_index_bank_]
                v_bank = bank_v[:, :local_end_index_bank_]
            else:
                k_bank = bank_k[:, :0]
                v_bank = bank_v[:, :0]
        else:
            k_bank = bank_k[:, :local_end_index_bank_]
            v_bank = bank_v[:, :local_end_index_bank_]

        k_cat = torch.cat([k_sink, k_bank, k_local], dim=1)
        v_cat = torch.cat([v_sink, v_bank, v_local], dim=1)
        x = attention(roped_query, k_cat, v_cat)

        x = x.flatten(2)
        x = self.o(x)
        return x, (current_end, local_end_index, cache_update_info)


class CausalWanAttentionBlock(nn.Module):
    def __init__(self, dim, ffn_dim, num_heads, local_attn_size, sink_size, record_interval):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.self_attn = CausalWanSelfAttention(dim, num_heads, local_attn_size, sink_size,
                                                record_interval=record_interval)
        self.norm2 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.ffn = nn.Sequential(nn.Linear(dim, ffn_dim), nn.GELU(approximate="tanh"), nn.Linear(ffn_dim, dim))

    def forward(self, x, grid_sizes, freqs, kv_cache, current_start, kv_bank):
        y, info = self.self_attn(self.norm1(x), grid_sizes, freqs, kv_cache, current_start, kv_bank)
        x = x + y
        x = x + self.ffn(self.norm2(x))
        return x, info


class CausalWanModel(nn.Module):
    def __init__(self, dim=32, ffn_dim=64, num_heads=2, num_layers=2, local_attn_size=12, sink_size=3,
                 bank_size=3, record_interval=3):
        super().__init__()
        self.dim, self.num_heads, self.bank_size = dim, num_heads, bank_size
        self.blocks = nn.ModuleList(
            [CausalWanAttentionBlock(dim, ffn_dim, num_heads, local_attn_size, sink_size, record_interval)
             for _ in range(num_layers)]
        )
        d = dim // num_heads
        self.freqs = torch.cat(
            [rope_params(1024, d - 4 * (d // 6)), rope_params(1024, 2 * (d // 6)), rope_params(1024, 2 * (d // 6))],
            dim=1,
        )
        self.head = nn.Linear(dim, dim)

    def _apply_cache_updates(self, kv_cache, cache_update_infos, kv_bank=None, update_bank=True):
        for block_index, (current_end, local_end_index, update_info) in cache_update_infos:
            cache = kv_cache[block_index]
            bank = kv_bank[block_index]
            frame_seqlen = update_info["frame_seqlen"]
            ws, we = update_info["write_start_index"], update_info["write_end_index"]
            new_k, new_v = update_info["new_k"], update_info["new_v"]
            if we > ws and new_k.shape[1] == (we - ws):
                cache["k"][:, ws:we] = new_k
                cache["v"][:, ws:we] = new_v
                if update_bank:
                    bank["k_new"][:, :] = new_k[:, :frame_seqlen]
                    bank["v_new"][:, :] = new_v[:, :frame_seqlen]
            if not update_info["is_recompute"]:
                kv_cache[block_index]["global_end_index"].fill_(current_end)
                kv_cache[block_index]["local_end_index"].fill_(local_end_index)
                if update_bank:
                    kv_bank[block_index]["global_end_index"].fill_(update_info["current_end_bank"])
                    kv_bank[block_index]["local_end_index"].fill_(update_info["local_end_index_bank"])

    def forward(self, x, grid_sizes, kv_cache, kv_bank, current_start, update_bank=False, update_cache=False):
        infos = []
        for block_index, block in enumerate(self.blocks):
            x, info = block(x, grid_sizes, self.freqs, kv_cache[block_index], current_start, kv_bank[block_index])
            infos.append((block_index, info))
        if update_cache:
            self._apply_cache_updates(kv_cache, infos, kv_bank, update_bank=update_bank)
        return self.head(x)


def initialize_kv_cache(model, frame_seq_length, local_attn_size):
    size = local_attn_size * frame_seq_length
    shape = [1, size, model.num_heads, model.dim // model.num_heads]
    return [
        {"k": torch.zeros(shape), "v": torch.zeros(shape),
         "global_end_index": torch.tensor([0], dtype=torch.long),
         "local_end_index": torch.tensor([0], dtype=torch.long)}
        for _ in model.blocks
    ]


def initialize_kv_bank(model, frame_seq_length):
    shape = [1, model.bank_size * frame_seq_length, model.num_heads, model.dim // model.num_heads]
    new_shape = [1, frame_seq_length, model.num_heads, model.dim // model.num_heads]
    return [
        {"k": torch.zeros(shape), "v": torch.zeros(shape), "k_new": torch.zeros(new_shape),
         "v_new": torch.zeros(new_shape),
         "global_end_index": torch.tensor([0], dtype=torch.long),
         "local_end_index": torch.tensor([0], dtype=torch.long)}
        for _ in model.blocks
    ]


class PipelineConfig:
    # top-level keys of memflow/model.yaml (record_interval sits under base_model_kwargs)
    num_frame_per_block = 3
    local_attn_size = 12
    bank_size = 3


def main():
    config = PipelineConfig()
    model = CausalWanModel(local_attn_size=config.local_attn_size, bank_size=config.bank_size).eval()
    h, w = 2, 2
    frame_seq_length = h * w
    kv_cache = initialize_kv_cache(model, frame_seq_length, config.local_attn_size)
    kv_bank = initialize_kv_bank(model, frame_seq_length)
    nf = config.num_frame_per_block
    grid_sizes = torch.tensor([[nf, h, w]])

    with torch.no_grad():
        for block_idx in range(4):
            current_start_frame = block_idx * nf
            latents = torch.randn(1, nf * frame_seq_length, model.dim)
            # denoise pass (reads the caches)
            denoised = model(latents, grid_sizes, kv_cache, kv_bank, current_start_frame * frame_seq_length)
            # clean pass (CleanKVCacheBlock): writes the block into the KV cache
            record_interval = getattr(config, "record_interval", None)
            update_bank = record_interval is not None and current_start_frame % (3 * record_interval) == 0
            model(latents, grid_sizes, kv_cache, kv_bank, current_start_frame * frame_seq_length,
                  update_bank=update_bank, update_cache=True)
            print(f"block {block_idx} (frames {current_start_frame}-{current_start_frame + nf - 1}): "
                  f"denoised[0, :4] = {[round(t, 4) for t in denoised[0, 0, :4].tolist()]}, "
                  f"bank global_end_index = {kv_bank[0]['global_end_index'].item()}")


if __name__ == "__main__":
    main()
