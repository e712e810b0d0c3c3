# NVIDIA/TensorRT-Model-Connect#950 (commit f163f2f65, "fix(sam): restore prompted segmentation parity").
# SamPlugin._build_windowed_attention treated SAM's local window-attention layers as global attention over the whole
# patch grid ("windowed attention is a subset of global attention"), so every patch attended to every other patch of
# the image in the layers trained with 14x14 windows. The fix partitions (with zero padding) into windows, attends
# within each window, unpartitions and crops. Ported from the TensorRT graph builder to torch ops, same structure.
import sys

import numpy as np
import torch
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

SAM_CFG = {
    "hidden_size": 32,
    "num_hidden_layers": 4,
    "num_attention_heads": 2,
    "mlp_dim": 64,
    "image_size": 320,
    "patch_size": 16,
    "window_size": 14,
    "global_attn_indexes": [1, 3],
}


def make_weights(cfg):
    hidden, mlp_dim = cfg["hidden_size"], cfg["mlp_dim"]
    head_dim = hidden // cfg["num_attention_heads"]
    grid = cfg["image_size"] // cfg["patch_size"]
    g = lambda *s: (torch.randn(*s) * 0.2).numpy().astype(np.float32)
    w = {
        "encoder.patch_embed.weight": g(hidden, 3, cfg["patch_size"], cfg["patch_size"]),
        "encoder.patch_embed.bias": g(hidden),
        "encoder.pos_embed": g(1, grid, grid, hidden),
    }
    for i in range(cfg["num_hidden_layers"]):
        p = f"encoder.layer{i}"
        size = grid if i in cfg["global_attn_indexes"] else cfg["window_size"]
        w[f"{p}.norm1.weight"] = np.ones(hidden, np.float32)
        w[f"{p}.norm1.bias"] = np.zeros(hidden, np.float32)
        w[f"{p}.norm2.weight"] = np.ones(hidden, np.float32)
        w[f"{p}.norm2.bias"] = np.zeros(hidden, np.float32)
        for n in ("q", "k", "v", "o"):
            w[f"{p}.attn.{n}.weight"] = g(hidden, hidden)
            w[f"{p}.attn.{n}.bias"] = g(hidden)
        w[f"{p}.attn.rel_pos_h"] = g(2 * size - 1, head_dim)
        w[f"{p}.attn.rel_pos_w"] = g(2 * size - 1, head_dim)
        w[f"{p}.mlp.fc1.weight"] = g(mlp_dim, hidden)
        w[f"{p}.mlp.fc1.bias"] = g(mlp_dim)
        w[f"{p}.mlp.fc2.weight"] = g(hidden, mlp_dim)
        w[f"{p}.mlp.fc2.bias"] = g(hidden)
    return w


def T(a):
    return torch.from_numpy(np.ascontiguousarray(a))


class SamPlugin:
    @staticmethod
    def _build_windowed_attention(inp_4d, weights, w_prefix, grid_size, hidden, num_heads, head_dim, window_size):
        if not FIXED:
            return SamPlugin._build_spatial_attention(
                inp_4d, weights, w_prefix, batch_size=1, spatial_size=grid_size,
                hidden=hidden, num_heads=num_heads, head_dim=head_dim)

        padded_size = ((grid_size + window_size - 1) // window_size) * window_size
        window_count = padded_size // window_size
        pad_size = padded_size - grid_size

        padded = inp_4d
        if pad_size:
            pad_right = torch.zeros((1, grid_size, pad_size, hidden))
            padded = torch.cat([padded, pad_right], dim=2)
            pad_bottom = torch.zeros((1, pad_size, padded_size, hidden))
            padded = torch.cat([padded, pad_bottom], dim=1)

        partition = padded.reshape(1, window_count, window_size, window_count, window_size, hidden)
        partition = partition.permute(0, 1, 3, 2, 4, 5)
        windows = partition.reshape(window_count * window_count, window_size, window_size, hidden)
        attended = SamPlugin._build_spatial_attention(
            windows, weights, w_prefix, batch_size=window_count * window_count, spatial_size=window_size,
            hidden=hidden, num_heads=num_heads, head_dim=head_dim)

        grouped = attended.reshape(1, window_count, window_count, window_size, window_size, hidden)
        grouped = grouped.permute(0, 1, 3, 2, 4, 5)
        unpartitioned = grouped.reshape(1, padded_size, padded_size, hidden)
        if not pad_size:
            return unpartitioned
        return unpartitioned[:, :grid_size, :grid_size, :]

    @staticmethod
    def _build_spatial_attention(inp_4d, weights, w_prefix, *, batch_size, spatial_size, hidden, num_heads, head_dim):
        """Build SAM attention over one or more equally sized spatial grids."""
        seq_len = spatial_size * spatial_size
        attn_scale = 1.0 / np.sqrt(max(head_dim, 1))

        flat = inp_4d.reshape(batch_size * seq_len, hidden)
        q = flat @ T(weights[f"{w_prefix}.attn.q.weight"]).T + T(weights[f"{w_prefix}.attn.q.bias"])
        k = flat @ T(weights[f"{w_prefix}.attn.k.weight"]).T + T(weights[f"{w_prefix}.attn.k.bias"])
        v = flat @ T(weights[f"{w_prefix}.attn.v.weight"]).T + T(weights[f"{w_prefix}.attn.v.bias"])

        q_h = q.reshape(batch_size, seq_len, num_heads, head_dim).permute(0, 2, 1, 3)
        k_h = k.reshape(batch_size, seq_len, num_heads, head_dim).permute(0, 2, 1, 3)
        v_h = v.reshape(batch_size, seq_len, num_heads, head_dim).permute(0, 2, 1, 3)

        scaled = (q_h @ k_h.transpose(-1, -2)) * attn_scale

        # HF SAM's decomposed relative-position bias depends on each query.
        if f"{w_prefix}.attn.rel_pos_h" in weights:
            rp_h = T(SamPlugin._get_rel_pos(spatial_size, spatial_size, weights[f"{w_prefix}.attn.rel_pos_h"]))
            rp_w = T(SamPlugin._get_rel_pos(spatial_size, spatial_size, weights[f"{w_prefix}.attn.rel_pos_w"]))
            q_4d = q_h.reshape(batch_size, num_heads, spatial_size, spatial_size, head_dim)
            rel_h = torch.einsum("bnhwc,hkc->bnhwk", q_4d, rp_h)
            rel_w = torch.einsum("bnhwc,wkc->bnhwk", q_4d, rp_w)
            rel_bias = rel_h[..., :, None] + rel_w[..., None, :]
            scaled = scaled + rel_bias.reshape(batch_size, num_heads, seq_len, seq_len)

        softmax = scaled.softmax(dim=-1)
        ctx = softmax @ v_h
        ctx_flat = ctx.permute(0, 2, 1, 3).reshape(batch_size * seq_len, hidden)
        out = ctx_flat @ T(weights[f"{w_prefix}.attn.o.weight"]).T + T(weights[f"{w_prefix}.attn.o.bias"])
        return out.reshape(batch_size, spatial_size, spatial_size, hidden)

    @staticmethod
    def _build_global_attention(inp_4d, weights, w_prefix, grid_size, hidden, num_heads, head_dim, seq_len):
        """Build SAM's full-image attention layers."""
        del seq_len
        return SamPlugin._build_spatial_attention(
            inp_4d, weights, w_prefix, batch_size=1, spatial_size=grid_size,
            hidden=hidden, num_heads=num_heads, head_dim=head_dim)

    @staticmethod
    def _get_rel_pos(q_size, k_size, rel_pos):
        """Get relative positional embeddings, matching HF SAM's get_rel_pos."""
        max_rel_dist = int(2 * max(q_size, k_size) - 1)
        if rel_pos.shape[0] != max_rel_dist:
            x_old = np.linspace(0, 1, rel_pos.shape[0])
            x_new = np.linspace(0, 1, max_rel_dist)
            rel_pos_resized = np.stack(
                [np.interp(x_new, x_old, rel_pos[:, c]) for c in range(rel_pos.shape[1])], axis=1
            ).astype(np.float32)
        else:
            rel_pos_resized = rel_pos
        q_coords = np.arange(q_size)[:, None] * max(k_size / q_size, 1.0)
        k_coords = np.arange(k_size)[None, :] * max(q_size / k_size, 1.0)
        relative_coords = (q_coords - k_coords) + (k_size - 1) * max(q_size / k_size, 1.0)
        indices = relative_coords.astype(np.int64)
        indices = np.clip(indices, 0, max_rel_dist - 1)
        return rel_pos_resized[indices]

    def encode_image(self, pixel_values, weights, sam_cfg):
        hidden = sam_cfg["hidden_size"]
        num_heads = sam_cfg["num_attention_heads"]
        head_dim = hidden // num_heads
        window_size = sam_cfg["window_size"]
        global_attn_indexes = set(sam_cfg["global_attn_indexes"])
        grid_size = sam_cfg["image_size"] // sam_cfg["patch_size"]
        seq_len = grid_size * grid_size

        patch = F.conv2d(pixel_values, T(weights["encoder.patch_embed.weight"]), T(weights["encoder.patch_embed.bias"]),
                         stride=sam_cfg["patch_size"])
        hidden_state = patch.permute(0, 2, 3, 1) + T(weights["encoder.pos_embed"])

        for layer_idx in range(sam_cfg["num_hidden_layers"]):
            w_prefix = f"encoder.layer{layer_idx}"
            use_window = layer_idx not in global_attn_indexes
            normed = F.layer_norm(hidden_state.reshape(seq_len, hidden), (hidden,),
                                  T(weights[f"{w_prefix}.norm1.weight"]), T(weights[f"{w_prefix}.norm1.bias"]), 1e-6)
            normed_4d = normed.reshape(1, grid_size, grid_size, hidden)
            if use_window:
                attn_out_4d = self._build_windowed_attention(
                    normed_4d, weights, w_prefix, grid_size, hidden, num_heads, head_dim, window_size)
            else:
                attn_out_4d = self._build_global_attention(
                    normed_4d, weights, w_prefix, grid_size, hidden, num_heads, head_dim, seq_len)
            res1 = hidden_state + attn_out_4d
            normed2 = F.layer_norm(res1.reshape(seq_len, hidden), (hidden,),
                                   T(weights[f"{w_prefix}.norm2.weight"]), T(weights[f"{w_prefix}.norm2.bias"]), 1e-6)
            fc1 = normed2 @ T(weights[f"{w_prefix}.mlp.fc1.weight"]).T + T(weights[f"{w_prefix}.mlp.fc1.bias"])
            fc2 = F.gelu(fc1, approximate="tanh") @ T(weights[f"{w_prefix}.mlp.fc2.weight"]).T
            fc2 = fc2 + T(weights[f"{w_prefix}.mlp.fc2.bias"])
            hidden_state = res1 + fc2.reshape(1, grid_size, grid_size, hidden)
        return hidden_state


weights = make_weights(SAM_CFG)
pixel_values = torch.randn(1, 3, SAM_CFG["image_size"], SAM_CFG["image_size"])
with torch.no_grad():
    image_embeddings = SamPlugin().encode_image(pixel_values, weights, SAM_CFG)
print(f"image embedding norm {image_embeddings.norm().item():.6f}")
