"""TensorRT-Model-Connect Z-Image: the DiT attended every fixed caption slot, used or not.

Citation: NVIDIA/TensorRT-Model-Connect commit ca746dae9 ("fix(z-image): align DiT caption
semantics with HF", closes #386): python/tensorrt_model_connect/families/z_image/
z_image_dit_builder.py (``build_z_image_dit_engine``, ``_add_plain_dit_block``,
``_add_adaln_dit_block``, ``_multi_head_attention``) and src/runtime/models/z_image/pipeline.cpp
(``project_caption``, ``run_qwen3_encoder_for_chunk``, ``run_denoiser``,
``make_z_image_attention_mask``).

The engine is built with static shapes: the caption always occupies ``text_seq_len`` slots after
the ``num_patches`` image tokens. The runtime writes the projected caption into the first slots
and fills every slot from ``cap_ori_len`` on with the learned ``cap_pad_token``; HF/Diffusers
only keeps the caption padded up to the next multiple of 32 (``cap_padded_len``).

The bug: the engine had no ``attention_mask`` input and every attention ran unmasked, so the
context refiner and the unified (image + caption) blocks attended all ``text_seq_len`` slots,
including the unused ones past ``cap_padded_len``.
The fix: a float ``attention_mask`` input of ``total_seq`` (0 for the patches and the first
``cap_padded_len`` caption slots, -1e9 beyond, from ``make_z_image_attention_mask``), reshaped to
[1, 1, 1, total_seq] for the unified blocks and sliced to the caption part for the context
refiner. (The same commit also made the Qwen3 text encoder causal and fixed its hidden-state
index; this program keeps the DiT half.)

This program renders the TensorRT network in torch (one function per builder helper, the
attention as SDPA with the additive mask the builder passes to IAttention) and the C++ runtime
around it in Python, at toy sizes with random weights: 16 patches, 64 caption slots, a 10-token
caption (cap_padded_len = 32), 2 denoising steps. RoPE is left out.
"""

import sys

import torch
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv

torch.manual_seed(0)

kSeqMultipleOf = 32


# ---- weights (names as load_z_image_dit_weights maps them) --------------------------------------
def make_weights(dim, ffn_dim, adaln_dim, n_refiner, n_layers, out_channels, te_dim):
    w = {}

    def lin(name, i, o):
        w[name] = torch.randn(i, o) / i ** 0.5

    def block(tp, adaln):
        for n in ("wq", "wk", "wv", "to_out"):
            lin(f"{tp}.{n}", dim, dim)
        lin(f"{tp}.ff_w1", dim, ffn_dim)
        lin(f"{tp}.ff_w3", dim, ffn_dim)
        lin(f"{tp}.ff_w2", ffn_dim, dim)
        for n in ("attn_norm1", "attn_norm2", "ffn_norm1", "ffn_norm2"):
            w[f"{tp}.{n}"] = torch.ones(dim)
        if adaln:
            lin(f"{tp}.adaln.weight", adaln_dim, 4 * dim)
            w[f"{tp}.adaln.bias"] = torch.zeros(4 * dim)

    for i in range(n_refiner):
        block(f"noise_refiner.{i}", True)
        block(f"context_refiner.{i}", False)
    for i in range(n_layers):
        block(f"main.{i}", True)
    lin("final_adaLN.weight", adaln_dim, dim)
    w["final_adaLN.bias"] = torch.zeros(dim)
    lin("final_linear.weight", dim, out_channels)
    w["cap_norm_weight"] = torch.ones(te_dim)
    lin("cap_proj_weight", te_dim, dim)
    w["cap_proj_bias"] = torch.zeros(dim)
    w["cap_pad_token"] = torch.randn(dim)
    return w


# ---- z_image_dit_builder.py (TensorRT network, rendered in torch) --------------------------------
def add_rms_norm(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _multi_head_attention(q, k, v, num_heads, head_dim, q_seq, kv_seq, scale, mask=None):
    """graph_ops.add_attention_from_rows: rows [S, H*D] -> IAttention with an additive mask."""
    q4 = q.view(q_seq, num_heads, head_dim).transpose(0, 1)[None]
    k4 = k.view(kv_seq, num_heads, head_dim).transpose(0, 1)[None]
    v4 = v.view(kv_seq, num_heads, head_dim).transpose(0, 1)[None]
    ctx = F.scaled_dot_product_attention(q4, k4, v4, attn_mask=mask, scale=scale)
    return ctx[0].transpose(0, 1).reshape(q_seq, num_heads * head_dim)


def _feed_forward(x, w, tp):
    return (F.silu(x @ w[f"{tp}.ff_w1"]) * (x @ w[f"{tp}.ff_w3"])) @ w[f"{tp}.ff_w2"]


def _add_plain_dit_block(x, w, tp, num_heads, head_dim, seq_len, eps, scale, attention_mask=None):
    normed = add_rms_norm(x, w[f"{tp}.attn_norm1"], eps)
    q, k, v = normed @ w[f"{tp}.wq"], normed @ w[f"{tp}.wk"], normed @ w[f"{tp}.wv"]
    attn_out = _multi_head_attention(q, k, v, num_heads, head_dim, seq_len, seq_len, scale,
                                     mask=attention_mask) @ w[f"{tp}.to_out"]
    x = x + add_rms_norm(attn_out, w[f"{tp}.attn_norm2"], eps)
    ffn_out = _feed_forward(add_rms_norm(x, w[f"{tp}.ffn_norm1"], eps), w, tp)
    return x + add_rms_norm(ffn_out, w[f"{tp}.ffn_norm2"], eps)


def _add_adaln_dit_block(x, w, tp, temb, num_heads, head_dim, seq_len, eps, scale,
                         attention_mask=None):
    mod = temb @ w[f"{tp}.adaln.weight"] + w[f"{tp}.adaln.bias"]
    scale_msa, gate_msa, scale_mlp, gate_mlp = mod.chunk(4, dim=-1)
    gate_msa, gate_mlp = torch.tanh(gate_msa), torch.tanh(gate_mlp)
    normed = add_rms_norm(x, w[f"{tp}.attn_norm1"], eps) * (1 + scale_msa)
    q, k, v = normed @ w[f"{tp}.wq"], normed @ w[f"{tp}.wk"], normed @ w[f"{tp}.wv"]
    attn_out = _multi_head_attention(q, k, v, num_heads, head_dim, seq_len, seq_len, scale,
                                     mask=attention_mask) @ w[f"{tp}.to_out"]
    x = x + gate_msa * add_rms_norm(attn_out, w[f"{tp}.attn_norm2"], eps)
    ffn_out = _feed_forward(add_rms_norm(x, w[f"{tp}.ffn_norm1"], eps) * (1 + scale_mlp), w, tp)
    return x + gate_mlp * add_rms_norm(ffn_out, w[f"{tp}.ffn_norm2"], eps)


def z_image_dit_engine(w, inputs, *, num_heads, num_layers, num_refiner_layers, num_patches,
                       text_seq_len, head_dim, eps=1e-5):
    """build_z_image_dit_engine(...) executed on one set of engine inputs."""
    total_seq = num_patches + text_seq_len
    scale = 1.0 / head_dim ** 0.5
    noise = inputs["hidden_states"]
    caption = inputs["encoder_hidden_states"]
    temb = inputs["timestep_embedding"]
    full_attention_mask = cap_attention_mask = None
    if FIXED:
        attention_mask = inputs["attention_mask"]
        full_attention_mask = attention_mask.reshape(1, 1, 1, total_seq)
        cap_attention_mask = attention_mask[num_patches:num_patches + text_seq_len].reshape(
            1, 1, 1, text_seq_len)

    # --- Noise refiner (on noise only, with AdaLN) ---
    for i in range(num_refiner_layers):
        noise = _add_adaln_dit_block(noise, w, f"noise_refiner.{i}", temb, num_heads, head_dim,
                                     num_patches, eps, scale)
    # --- Context refiner (on caption only, no AdaLN) ---
    for i in range(num_refiner_layers):
        caption = _add_plain_dit_block(caption, w, f"context_refiner.{i}", num_heads, head_dim,
                                       text_seq_len, eps, scale, attention_mask=cap_attention_mask)
    # --- Main layers (unified: noise + caption concatenated) ---
    for i in range(num_layers):
        unified_t = torch.cat([noise, caption], dim=0)
        unified_t = _add_adaln_dit_block(unified_t, w, f"main.{i}", temb, num_heads, head_dim,
                                         total_seq, eps, scale,
                                         attention_mask=full_attention_mask)
        noise, caption = unified_t[:num_patches], unified_t[num_patches:]
    # --- Final layer ---
    final_scale = F.silu(temb) @ w["final_adaLN.weight"] + w["final_adaLN.bias"] + 1.0
    noise_ln = F.layer_norm(noise, (noise.shape[-1],), eps=1e-6)
    return (noise_ln * final_scale) @ w["final_linear.weight"]


# ---- pipeline.cpp (runtime) --------------------------------------------------------------------
def pad_to_next_multiple(value, multiple):
    rem = value % multiple
    return value if rem == 0 else value + (multiple - rem)


def project_caption(w, text_emb, actual_len, text_seq):
    normed = add_rms_norm(text_emb, w["cap_norm_weight"], 1e-5)
    projected = normed @ w["cap_proj_weight"] + w["cap_proj_bias"]
    # Fill padding positions (actual_len..text_seq) with cap_pad_token
    projected[actual_len:text_seq] = w["cap_pad_token"]
    return projected


def make_z_image_attention_mask(num_patches, text_seq_len, cap_padded_len):
    clamped_caption_len = max(0, min(cap_padded_len, text_seq_len))
    mask = torch.full((num_patches + text_seq_len,), -1.0e9)
    mask[: num_patches + clamped_caption_len] = 0.0
    return mask


def timestep_embedding(t, dim):
    half = dim // 2
    freqs = torch.exp(-torch.log(torch.tensor(10000.0)) * torch.arange(half) / half)
    args = t * 1000.0 * freqs
    return torch.cat([torch.cos(args), torch.sin(args)])[None]


def main():
    dim, num_heads, head_dim, ffn_dim, adaln_dim, te_dim = 32, 2, 16, 64, 16, 24
    num_patches, text_seq_len, patch_dim = 16, 64, 8
    num_refiner_layers, num_layers = 1, 2
    w = make_weights(dim, ffn_dim, adaln_dim, num_refiner_layers, num_layers, patch_dim, te_dim)
    w["x_embedder"] = torch.randn(patch_dim, dim) / patch_dim ** 0.5

    # run_text_encoder: text_seq_len rows, padding rows zeroed
    cap_ori_len = 10
    text_embeddings = torch.zeros(text_seq_len, te_dim)
    text_embeddings[:cap_ori_len] = torch.randn(cap_ori_len, te_dim)
    cap_padded_len = pad_to_next_multiple(cap_ori_len, kSeqMultipleOf)
    caption_projected = project_caption(w, text_embeddings, cap_ori_len, text_seq_len)
    if FIXED:
        attention_mask = make_z_image_attention_mask(num_patches, text_seq_len, cap_padded_len)

    latents = torch.randn(num_patches, patch_dim)
    num_inference_steps = 2
    sigmas = torch.linspace(1.0, 0.0, num_inference_steps + 1)
    with torch.no_grad():
        for step in range(num_inference_steps):
            inputs = {
                "hidden_states": latents @ w["x_embedder"],
                "encoder_hidden_states": caption_projected,
                "timestep_embedding": timestep_embedding(1.0 - sigmas[step], adaln_dim),
            }
            if FIXED:
                inputs["attention_mask"] = attention_mask
            velocity = z_image_dit_engine(
                w, inputs, num_heads=num_heads, num_layers=num_layers,
                num_refiner_layers=num_refiner_layers, num_patches=num_patches,
                text_seq_len=text_seq_len, head_dim=head_dim)
            latents = latents + (sigmas[step + 1] - sigmas[step]) * velocity
    print("latents[0, :4]:", [round(x, 4) for x in latents[0, :4].tolist()])
    print("latents mean/std:", round(latents.mean().item(), 4), round(latents.std().item(), 4))


if __name__ == "__main__":
    main()
