"""AI-Hypercomputer/maxtext#5295 ("[Qwen3.5] Mask left-padding tokens in Qwen3NextGatedDeltaNet ...", merged).
src/maxtext/models/qwen3.py, Qwen3NextGatedDeltaNet.__call__ (pre-fix state read at 002f851), JAX ported to torch.

Bug: with a left-padded batch (decoder_segment_ids == 0 on the pads) Step C zeroed key / value / g at the pad
positions before the gated delta rule, but Step B ran the causal depthwise conv1d (kernel 4) over the raw
concatenated qkv, so the pad tokens' projections were smeared into the first 3 real tokens' q / k / v.
Fix: qkv = jnp.where((decoder_segment_ids != 0)[..., None], qkv, 0.0) before the convolution.

A tiny Qwen3-Next hybrid (GDN layer, GDN layer, gated full-attention layer), train-mode forward + masked loss.
"""
import math
import sys
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

MODEL_MODE_TRAIN = "train"

config = SimpleNamespace(
    vocab_size=64,
    emb_dim=32,
    num_decoder_layers=3,
    inhomogeneous_layer_cycle_interval=3,  # layers 0, 1: GDN; layer 2: full attention
    gdn_num_value_heads=4,
    gdn_num_key_heads=2,
    gdn_key_head_dim=8,
    gdn_value_head_dim=8,
    gdn_conv_kernel_dim=4,
    gdn_chunk_size=8,
    use_qk_norm_in_gdn=True,
    num_query_heads=4,
    num_kv_heads=2,
    head_dim=8,
    partial_rotary_factor=0.25,
    rope_max_timescale=10000,
    mlp_dim=64,
    normalization_layer_epsilon=1e-6,
    dtype=torch.float32,
)


def l2norm(x, dim=-1, eps=1e-6):
    inv_norm = torch.rsqrt((x * x).sum(dim=dim, keepdim=True) + eps)
    return x * inv_norm


def jax_chunk_gated_delta_rule(query, key, value, g, beta, chunk_size=64, initial_state=None,
                               use_qk_norm_in_gdn=False, compute_dtype=torch.float32):
    """Optimized JAX implementation of Gated Delta Rule (ported)."""
    initial_dtype = query.dtype
    if use_qk_norm_in_gdn:
        query = l2norm(query, dim=-1, eps=1e-6)
        key = l2norm(key, dim=-1, eps=1e-6)
    g = g.float()
    query, key, value, beta = (t.to(compute_dtype) for t in (query, key, value, beta))

    scale = torch.rsqrt(torch.tensor(float(query.shape[-1]))).to(compute_dtype)
    query = query * scale

    B, seq_len, H, K_dim = key.shape
    V_dim = value.shape[-1]
    pad_len = (chunk_size - (seq_len % chunk_size)) % chunk_size
    if pad_len > 0:
        def pad_fn(x):
            pad = [0, 0] * (x.ndim - 2) + [0, pad_len]
            return F.pad(x, pad)
        query, key, value, g, beta = (pad_fn(t) for t in (query, key, value, g, beta))

    num_chunks = query.shape[1] // chunk_size

    def to_chunk(x):
        return x.reshape(B, num_chunks, chunk_size, H, -1).permute(0, 1, 3, 2, 4)

    def to_chunk_scalar(x):
        return x.reshape(B, num_chunks, chunk_size, H).permute(0, 1, 3, 2)

    q_c, k_c, v_c = to_chunk(query), to_chunk(key), to_chunk(value)
    g_c, beta_c = to_chunk_scalar(g), to_chunk_scalar(beta)

    g_cumsum = torch.cumsum(g_c, dim=-1)
    k_beta = k_c * beta_c[..., None]
    S = (k_beta @ k_c.transpose(-1, -2)).float()
    g_diff = g_cumsum[..., :, None] - g_cumsum[..., None, :]
    mask = torch.tril(torch.ones(chunk_size, chunk_size, dtype=torch.bool), diagonal=-1)
    g_diff = torch.where(mask, g_diff, torch.full_like(g_diff, -1e30))
    S = S * torch.exp(g_diff)
    S = torch.where(mask, S, torch.zeros_like(S))

    identity = torch.eye(chunk_size, dtype=torch.float32)
    identity_broadcasted = identity.expand(S.shape)
    A = torch.linalg.solve_triangular(identity + S, identity_broadcasted, upper=False, unitriangular=True)

    v_beta = v_c * beta_c[..., None]
    u_chunks = (A @ v_beta.float()).to(compute_dtype)
    k_beta_g = k_beta.float() * torch.exp(g_cumsum)[..., None]
    w_chunks = (A @ k_beta_g).to(compute_dtype)

    if initial_state is None:
        h = torch.zeros(B, H, K_dim, V_dim, dtype=torch.float32)
    else:
        h = initial_state.float()

    mask_intra = torch.tril(torch.ones(chunk_size, chunk_size, dtype=torch.bool))
    outs = []
    for n in range(num_chunks):  # lax.scan over chunks
        w, u, q, k, gg = w_chunks[:, n], u_chunks[:, n], q_c[:, n], k_c[:, n], g_cumsum[:, n]
        q_g = q.float() * torch.exp(gg)[..., None]
        attn_inter = q_g @ h
        v_prime = w.float() @ h
        v_new = u.float() - v_prime
        attn = (q @ k.transpose(-1, -2)).float()
        gd = gg[..., :, None] - gg[..., None, :]
        gd = torch.where(mask_intra, gd, torch.full_like(gd, -1e30))
        attn_i = attn * torch.exp(gd)
        attn_i = torch.where(mask_intra, attn_i, torch.zeros_like(attn_i))
        o_c = attn_inter + attn_i @ v_new
        h_new = h * torch.exp(gg[..., -1, None, None])
        k_i_g_diff = k.float() * torch.exp(gg[..., -1, None] - gg)[..., None]
        h = h_new + k_i_g_diff.transpose(-1, -2) @ v_new
        outs.append(o_c)

    o = torch.stack(outs, dim=1)  # (B, N, H, C, V)
    o = o.permute(0, 1, 3, 2, 4).reshape(B, -1, H, V_dim)
    if pad_len > 0:
        o = o[:, :seq_len]
    return o.to(initial_dtype), (h if initial_state is not None else None)


class Qwen3NextRMSNorm(nn.Module):
    def __init__(self, num_features, epsilon):
        super().__init__()
        self.scale = nn.Parameter(torch.zeros(num_features))  # Qwen3-Next: (1 + scale)
        self.epsilon = epsilon

    def forward(self, x):
        y = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.epsilon)
        return (y * (1.0 + self.scale)).to(x.dtype)


class Qwen3NextRMSNormGated(nn.Module):
    def __init__(self, num_features, epsilon):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(num_features))
        self.epsilon = epsilon

    def forward(self, hidden_states, gate):
        h = hidden_states.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.epsilon)
        h = self.weight * h
        return (h * F.silu(gate.float())).to(hidden_states.dtype)


class Qwen3NextGatedDeltaNet(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        cfg = config
        in_features = cfg.emb_dim
        self.num_v_heads = cfg.gdn_num_value_heads
        self.num_k_heads = cfg.gdn_num_key_heads
        self.head_k_dim = cfg.gdn_key_head_dim
        self.head_v_dim = cfg.gdn_value_head_dim
        self.key_dim = self.head_k_dim * self.num_k_heads
        self.value_dim = self.head_v_dim * self.num_v_heads
        conv_dim = self.key_dim * 2 + self.value_dim
        conv_kernel_size = cfg.gdn_conv_kernel_dim
        self.v_heads_per_k_head = self.num_v_heads // self.num_k_heads

        self.in_proj_qkvz = nn.Linear(in_features, self.key_dim * 2 + self.value_dim * 2, bias=False)
        self.in_proj_ba = nn.Linear(in_features, self.num_v_heads * 2, bias=False)
        # nnx.Conv(kernel_size=(K,), feature_group_count=conv_dim, padding="CAUSAL", use_bias=False)
        self.conv1d_kernel = nn.Parameter(torch.randn(conv_dim, 1, conv_kernel_size) * 0.5)
        self.A_log = nn.Parameter(torch.log(torch.empty(self.num_v_heads).uniform_(1e-9, 16.0)))
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.norm = Qwen3NextRMSNormGated(self.head_v_dim, cfg.normalization_layer_epsilon)
        self.out_proj = nn.Linear(self.value_dim, in_features, bias=False)

    def conv1d(self, x):
        # x: (B, L, C); "CAUSAL" padding pads kernel_size - 1 on the left.
        K = self.conv1d_kernel.shape[-1]
        x = F.pad(x.transpose(1, 2), (K - 1, 0))
        return F.conv1d(x, self.conv1d_kernel, groups=x.shape[1]).transpose(1, 2)

    def forward(self, hidden_states, model_mode=MODEL_MODE_TRAIN, kv_cache=None, decoder_segment_ids=None):
        cfg = self.config
        batch, seq_len, _ = hidden_states.shape

        # STEP A: Input Projections
        qkvz = self.in_proj_qkvz(hidden_states)
        ba = self.in_proj_ba(hidden_states)

        new_shape_qkvz = (batch, seq_len, self.num_k_heads,
                          2 * self.head_k_dim + 2 * self.head_v_dim * self.v_heads_per_k_head)
        mixed_qkvz = qkvz.reshape(new_shape_qkvz)
        split_sizes_qkvz = [self.head_k_dim, self.head_k_dim,
                            self.v_heads_per_k_head * self.head_v_dim, self.v_heads_per_k_head * self.head_v_dim]
        query, key, value_raw, z_raw = torch.split(mixed_qkvz, split_sizes_qkvz, dim=3)
        value = value_raw.reshape(batch, seq_len, self.num_v_heads, self.head_v_dim)
        z = z_raw.reshape(batch, seq_len, self.num_v_heads, self.head_v_dim)

        mixed_ba = ba.reshape(batch, seq_len, self.num_k_heads, 2 * self.v_heads_per_k_head)
        b_raw, a_raw = torch.split(mixed_ba, [self.v_heads_per_k_head, self.v_heads_per_k_head], dim=3)
        b = b_raw.reshape(batch, seq_len, self.num_v_heads)
        a = a_raw.reshape(batch, seq_len, self.num_v_heads)

        q = query.reshape(batch, seq_len, -1)
        k = key.reshape(batch, seq_len, -1)
        v = value.reshape(batch, seq_len, -1)

        # STEP B: 1D Convolution
        qkv = torch.cat([q, k, v], dim=-1)
        if FIXED and decoder_segment_ids is not None:
            # Mask pad positions (segment 0) BEFORE the causal 1D convolution.
            qkv = torch.where((decoder_segment_ids != 0)[..., None], qkv, torch.zeros_like(qkv))
        batch, seq_len, _ = qkv.shape
        conv_kernel_size = self.config.gdn_conv_kernel_dim

        # train mode, no cache
        conv_input = F.pad(qkv, (0, 0, conv_kernel_size - 1, 0))

        conv_out = self.conv1d(conv_input)
        conv_out = conv_out[:, -seq_len:, :]
        qkv_conv = F.silu(conv_out.float()).to(cfg.dtype)
        q_conv, k_conv, v_conv = torch.split(qkv_conv, [self.key_dim, self.key_dim, self.value_dim], dim=-1)

        query = q_conv.reshape(batch, seq_len, self.num_k_heads, self.head_k_dim)
        key = k_conv.reshape(batch, seq_len, self.num_k_heads, self.head_k_dim)
        value = v_conv.reshape(batch, seq_len, self.num_v_heads, self.head_v_dim)

        # STEP C: Gated Delta Rule Recurrence
        A_log = self.A_log.to(cfg.dtype)
        dt_bias = self.dt_bias.to(cfg.dtype)
        beta = torch.sigmoid(b)
        g = -torch.exp(A_log) * F.softplus(a + dt_bias)

        if decoder_segment_ids is not None:
            mask = decoder_segment_ids != 0
            key = torch.where(mask[..., None, None], key, torch.zeros_like(key))
            value = torch.where(mask[..., None, None], value, torch.zeros_like(value))
            g = torch.where(mask[..., None], g, torch.zeros_like(g))

        if self.num_v_heads > self.num_k_heads and self.num_v_heads % self.num_k_heads == 0:
            repeats = self.num_v_heads // self.num_k_heads
            query = torch.repeat_interleave(query, repeats, dim=2)
            key = torch.repeat_interleave(key, repeats, dim=2)

        core_attn_out, _ = jax_chunk_gated_delta_rule(
            query, key, value, g, beta,
            chunk_size=cfg.gdn_chunk_size,
            initial_state=None,
            use_qk_norm_in_gdn=cfg.use_qk_norm_in_gdn,
            compute_dtype=cfg.dtype,
        )

        # STEP D: Final Output Stage
        gated_output_reshaped = self.norm(core_attn_out, z)
        gated_output = gated_output_reshaped.reshape(batch, seq_len, -1)
        output = self.out_proj(gated_output)
        return output, None


def apply_partial_rope(x, positions, rotary_dim, max_timescale):
    x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]
    half = rotary_dim // 2
    inv = 1.0 / (max_timescale ** (torch.arange(half, dtype=torch.float32) * 2 / rotary_dim))
    ang = positions[:, :, None].float() * inv  # (B, S, half)
    sin, cos = torch.sin(ang)[:, :, None, :], torch.cos(ang)[:, :, None, :]
    x1, x2 = x_rot[..., :half], x_rot[..., half:]
    rot = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return torch.cat([rot, x_pass], dim=-1)


class Qwen3NextFullAttention(nn.Module):
    """Gated full attention; the mask is MaxText's dot-product mask: causal & same decoder segment."""

    def __init__(self, config):
        super().__init__()
        cfg = config
        self.cfg = cfg
        self.query = nn.Linear(cfg.emb_dim, cfg.num_query_heads * cfg.head_dim * 2, bias=False)  # q + gate
        self.key = nn.Linear(cfg.emb_dim, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.value = nn.Linear(cfg.emb_dim, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.out = nn.Linear(cfg.num_query_heads * cfg.head_dim, cfg.emb_dim, bias=False)
        self.query_norm = Qwen3NextRMSNorm(cfg.head_dim, cfg.normalization_layer_epsilon)
        self.key_norm = Qwen3NextRMSNorm(cfg.head_dim, cfg.normalization_layer_epsilon)

    def generate_attention_mask(self, decoder_segment_ids, q_len, kv_len):
        mask = None
        if decoder_segment_ids is not None:
            mask = decoder_segment_ids[:, :, None] == decoder_segment_ids[:, None, :]
        causal = torch.arange(q_len)[:, None] >= torch.arange(kv_len)[None, :]
        mask = causal[None] if mask is None else mask & causal[None]
        return mask[:, None]  # (B, 1, q, kv)

    def forward(self, inputs, decoder_segment_ids, decoder_positions):
        cfg = self.cfg
        B, S, _ = inputs.shape
        qg = self.query(inputs).reshape(B, S, cfg.num_query_heads, cfg.head_dim * 2)
        q, gate = qg.chunk(2, dim=-1)
        k = self.key(inputs).reshape(B, S, cfg.num_kv_heads, cfg.head_dim)
        v = self.value(inputs).reshape(B, S, cfg.num_kv_heads, cfg.head_dim)
        q, k = self.query_norm(q), self.key_norm(k)
        rot = int(cfg.head_dim * cfg.partial_rotary_factor)
        q = apply_partial_rope(q, decoder_positions, rot, cfg.rope_max_timescale)
        k = apply_partial_rope(k, decoder_positions, rot, cfg.rope_max_timescale)
        rep = cfg.num_query_heads // cfg.num_kv_heads
        k = k.repeat_interleave(rep, dim=2)
        v = v.repeat_interleave(rep, dim=2)
        attn_mask = self.generate_attention_mask(decoder_segment_ids, S, S)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             attn_mask=attn_mask)
        out = out.transpose(1, 2) * torch.sigmoid(gate)
        return self.out(out.reshape(B, S, -1))


class MlpBlock(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.wi_0 = nn.Linear(cfg.emb_dim, cfg.mlp_dim, bias=False)
        self.wi_1 = nn.Linear(cfg.emb_dim, cfg.mlp_dim, bias=False)
        self.wo = nn.Linear(cfg.mlp_dim, cfg.emb_dim, bias=False)

    def forward(self, x):
        return self.wo(F.silu(self.wi_0(x)) * self.wi_1(x))


class Qwen3NextDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        cfg = config
        self.is_full_attention = (layer_idx + 1) % cfg.inhomogeneous_layer_cycle_interval == 0
        self.input_layernorm = Qwen3NextRMSNorm(cfg.emb_dim, cfg.normalization_layer_epsilon)
        self.post_attention_layernorm = Qwen3NextRMSNorm(cfg.emb_dim, cfg.normalization_layer_epsilon)
        if self.is_full_attention:
            self.attention = Qwen3NextFullAttention(cfg)
        else:
            self.attention = Qwen3NextGatedDeltaNet(cfg)
        self.mlp = MlpBlock(cfg)

    def forward(self, inputs, decoder_segment_ids, decoder_positions, model_mode=MODEL_MODE_TRAIN):
        residual = inputs
        hidden_states = self.input_layernorm(inputs)
        if self.is_full_attention:
            attention_output = self.attention(hidden_states, decoder_segment_ids, decoder_positions)
        else:
            attention_output, _ = self.attention(hidden_states, model_mode=model_mode,
                                                 decoder_segment_ids=decoder_segment_ids)
        hidden_states = residual + attention_output
        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        return residual + self.mlp(hidden_states)


class Transformer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.token_embedder = nn.Embedding(config.vocab_size, config.emb_dim)
        self.layers = nn.ModuleList(Qwen3NextDecoderLayer(config, i) for i in range(config.num_decoder_layers))
        self.decoder_norm = Qwen3NextRMSNorm(config.emb_dim, config.normalization_layer_epsilon)
        self.logits_dense = nn.Linear(config.emb_dim, config.vocab_size, bias=False)

    def forward(self, decoder_input_tokens, decoder_positions, decoder_segment_ids, model_mode=MODEL_MODE_TRAIN):
        y = self.token_embedder(decoder_input_tokens)
        for layer in self.layers:
            y = layer(y, decoder_segment_ids, decoder_positions, model_mode)
        return self.logits_dense(self.decoder_norm(y))


def loss_fn(model, data):
    """MaxText train.loss_fn: cross entropy weighted by targets_segmentation != 0."""
    logits = model(data["inputs"], data["inputs_position"], data["inputs_segmentation"])
    one_hot_targets = F.one_hot(data["targets"], config.vocab_size).float()
    xent = -(one_hot_targets * F.log_softmax(logits.float(), dim=-1)).sum(-1)
    xent = xent * (data["targets_segmentation"] != 0)
    total_loss = xent.sum()
    total_weights = (data["targets_segmentation"] != 0).sum()
    return total_loss / total_weights, logits


def left_padded_batch(prompts, pad_id=0):
    """Rollout-style batch: left padding, segment 0 on the pads, positions counted from the first real token."""
    max_len = max(len(p) for p in prompts)
    inputs, targets, segs, positions = [], [], [], []
    for p in prompts:
        n_pad = max_len - len(p)
        seq = [pad_id] * n_pad + p
        inputs.append(seq[:-1])
        targets.append(seq[1:])
        seg = [0] * n_pad + [1] * len(p)
        segs.append(seg[:-1])
        positions.append([0] * n_pad + list(range(len(p) - 1)))
    inputs = torch.tensor(inputs)
    targets = torch.tensor(targets)
    segs = torch.tensor(segs)
    tseg = torch.tensor([[0] * (max_len - len(p)) + [1] * (len(p) - 1) for p in prompts])
    return {"inputs": inputs, "targets": targets, "inputs_segmentation": segs,
            "targets_segmentation": tseg, "inputs_position": torch.tensor(positions)}


model = Transformer(config).eval()
with torch.no_grad():
    for name, p in model.named_parameters():
        if "A_log" in name or "dt_bias" in name or "conv1d" in name:
            continue
        if p.ndim == 2:
            p.normal_(0.0, 0.3)

prompts = [
    [5, 17, 23, 9, 41, 12, 33, 8, 27, 50, 3, 19, 44, 6],  # longest, no padding
    [11, 7, 29, 36, 2, 58],                               # 8 left pads
    [14, 31, 47, 20, 9, 13, 25, 38, 61],                  # 5 left pads
]
data = left_padded_batch(prompts, pad_id=1)

with torch.no_grad():
    loss, logits = loss_fn(model, data)

print("loss:", round(loss.item(), 6))
for i, p in enumerate(prompts):
    print(f"row {i} next token after prompt: {logits[i, -1].argmax().item()}"
          f"  last logit[0:4]: {[round(x, 4) for x in logits[i, -1, :4].tolist()]}")
