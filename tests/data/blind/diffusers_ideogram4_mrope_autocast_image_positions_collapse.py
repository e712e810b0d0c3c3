# diffusers (huggingface/diffusers#13920, fixed by PR #13922, commit 6e8c8c4cac),
# src/diffusers/models/transformers/transformer_ideogram4.py (Ideogram4MRoPE.forward) and
# src/diffusers/pipelines/ideogram4/pipeline_ideogram4.py (Ideogram4Pipeline._prepare_ids).
# Bug: image tokens take MRoPE positions IMAGE_POSITION_OFFSET (65536) + (t, h, w). Ideogram4MRoPE casts position ids
# and inv_freq to float32, but the `inv_freq @ pos` matmul is on autocast's lower-precision list, so under an ambient
# torch.autocast(bfloat16) it runs in bfloat16, whose step at 65536 is 512: every image position of the grid rounds to
# the same value and all image tokens get the same rotary embedding. The fix runs that matmul with autocast disabled
# (float32) and returns cos / sin as float32.
# Trimmed to a tiny Ideogram4Transformer2DModel and one flow-matching training step under CPU bf16 autocast.
import inspect
import math
import sys
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

# Per-token role indicators used to label entries of the packed text+image sequence.
SEQUENCE_PADDING_INDICATOR = -1
OUTPUT_IMAGE_INDICATOR = 2
LLM_TOKEN_INDICATOR = 3

# Image grid coordinates start at this offset so they never collide with text token indices.
IMAGE_POSITION_OFFSET = 65536


class RMSNorm(nn.Module):
    def __init__(self, dim, eps, elementwise_affine=True):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if elementwise_affine else None

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        variance = hidden_states.to(torch.float32).pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.eps)
        if self.weight is not None:
            if self.weight.dtype in [torch.float16, torch.bfloat16]:
                hidden_states = hidden_states.to(self.weight.dtype)
            hidden_states = hidden_states * self.weight
        else:
            hidden_states = hidden_states.to(input_dtype)
        return hidden_states


def dispatch_attention_fn(query, key, value, attn_mask=None, backend=None, parallel_config=None):
    # native backend: (B, L, H, D) in and out
    query, key, value = (x.permute(0, 2, 1, 3) for x in (query, key, value))
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask)
    return out.permute(0, 2, 1, 3)


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Ideogram4MRoPE(nn.Module):
    """Multi-axis (t, h, w) interleaved rotary position embedding."""

    def __init__(self, head_dim, base, mrope_section):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.mrope_section = tuple(mrope_section)
        self.head_dim = head_dim

    def forward(self, position_ids):
        # position_ids: (B, L, 3) of int (axes are t, h, w).
        if position_ids.ndim != 3 or position_ids.shape[-1] != 3:
            raise ValueError(f"`position_ids` must have shape (B, L, 3), got {tuple(position_ids.shape)}.")
        batch_size, seq_len, _ = position_ids.shape

        pos = position_ids.permute(2, 0, 1).to(dtype=torch.float32)
        inv_freq = self.inv_freq.to(dtype=torch.float32)[None, None, :, None].expand(3, batch_size, -1, 1)
        if FIXED:
            with torch.autocast(device_type=position_ids.device.type, enabled=False):
                freqs = inv_freq @ pos.unsqueeze(2)
        else:
            freqs = inv_freq @ pos.unsqueeze(2)
        freqs = freqs.transpose(2, 3)  # (3, B, L, inv_freq_size)

        # Interleaved mrope: pull H freqs into idx 1 mod 3, W freqs into idx 2 mod 3.
        freqs_t = freqs[0].clone()
        for axis, offset in ((1, 1), (2, 2)):
            length = self.mrope_section[axis] * 3
            idx = torch.arange(offset, length, 3, device=freqs_t.device)
            freqs_t[..., idx] = freqs[axis][..., idx]

        emb = torch.cat((freqs_t, freqs_t), dim=-1)
        if FIXED:
            return emb.cos().float(), emb.sin().float()
        return emb.cos(), emb.sin()


class Ideogram4AttnProcessor:
    _attention_backend = None
    _parallel_config = None

    def __call__(self, attn, hidden_states, attention_mask, image_rotary_emb):
        query = attn.to_q(hidden_states).unflatten(-1, (attn.num_heads, attn.head_dim))
        key = attn.to_k(hidden_states).unflatten(-1, (attn.num_heads, attn.head_dim))
        value = attn.to_v(hidden_states).unflatten(-1, (attn.num_heads, attn.head_dim))

        query = attn.norm_q(query)
        key = attn.norm_k(key)

        # MRoPE applied in (B, L, num_heads, head_dim) layout; cos/sin broadcast over the head axis.
        cos, sin = image_rotary_emb
        cos = cos.unsqueeze(2)
        sin = sin.unsqueeze(2)
        query = (query * cos) + (_rotate_half(query) * sin)
        key = (key * cos) + (_rotate_half(key) * sin)

        hidden_states = dispatch_attention_fn(
            query,
            key,
            value,
            attn_mask=attention_mask,
            backend=self._attention_backend,
            parallel_config=self._parallel_config,
        )
        hidden_states = hidden_states.flatten(2, 3)
        return attn.to_out[0](hidden_states)


class Ideogram4Attention(nn.Module):
    """Self-attention with split Q/K/V, q/k RMSNorm, MRoPE and a block-diagonal segment mask."""

    def __init__(self, hidden_size, num_heads, eps=1e-5):
        super().__init__()
        self.hidden_size = hidden_size
        self.num_heads = num_heads
        self.head_dim = hidden_size // num_heads
        self.to_q = nn.Linear(hidden_size, hidden_size, bias=False)
        self.to_k = nn.Linear(hidden_size, hidden_size, bias=False)
        self.to_v = nn.Linear(hidden_size, hidden_size, bias=False)
        self.norm_q = RMSNorm(self.head_dim, eps=eps, elementwise_affine=True)
        self.norm_k = RMSNorm(self.head_dim, eps=eps, elementwise_affine=True)
        self.to_out = nn.ModuleList([nn.Linear(hidden_size, hidden_size, bias=False), nn.Dropout(0.0)])
        self.processor = Ideogram4AttnProcessor()

    def forward(self, hidden_states, attention_mask=None, image_rotary_emb=None, **kwargs):
        attn_parameters = set(inspect.signature(self.processor.__call__).parameters.keys())
        kwargs = {k: w for k, w in kwargs.items() if k in attn_parameters}
        return self.processor(self, hidden_states, attention_mask, image_rotary_emb, **kwargs)


class Ideogram4MLP(nn.Module):
    """SwiGLU feed-forward network."""

    def __init__(self, dim, hidden_dim):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Ideogram4TransformerBlock(nn.Module):
    def __init__(self, hidden_size, intermediate_size, num_heads, norm_eps, adaln_dim):
        super().__init__()
        self.attention = Ideogram4Attention(hidden_size, num_heads, eps=1e-5)
        self.feed_forward = Ideogram4MLP(hidden_size, intermediate_size)
        self.attention_norm1 = RMSNorm(hidden_size, eps=norm_eps, elementwise_affine=True)
        self.ffn_norm1 = RMSNorm(hidden_size, eps=norm_eps, elementwise_affine=True)
        self.attention_norm2 = RMSNorm(hidden_size, eps=norm_eps, elementwise_affine=True)
        self.ffn_norm2 = RMSNorm(hidden_size, eps=norm_eps, elementwise_affine=True)
        self.adaln_modulation = nn.Linear(adaln_dim, 4 * hidden_size, bias=True)

    def forward(self, hidden_states, attention_mask, image_rotary_emb, adaln_input):
        mod = self.adaln_modulation(adaln_input)
        scale_msa, gate_msa, scale_mlp, gate_mlp = mod.chunk(4, dim=-1)
        gate_msa = torch.tanh(gate_msa)
        gate_mlp = torch.tanh(gate_mlp)
        scale_msa = 1.0 + scale_msa
        scale_mlp = 1.0 + scale_mlp

        attn_out = self.attention(
            self.attention_norm1(hidden_states) * scale_msa,
            attention_mask=attention_mask,
            image_rotary_emb=image_rotary_emb,
        )
        hidden_states = hidden_states + gate_msa * self.attention_norm2(attn_out)
        hidden_states = hidden_states + gate_mlp * self.ffn_norm2(
            self.feed_forward(self.ffn_norm1(hidden_states) * scale_mlp)
        )
        return hidden_states


def _sinusoidal_embedding(t, dim, scale=1e4):
    t = t.to(torch.float32)
    half = dim // 2
    freq = math.log(scale) / (half - 1)
    freq = torch.exp(torch.arange(half, dtype=torch.float32, device=t.device) * -freq)
    emb = t.unsqueeze(-1) * freq
    emb = torch.cat([torch.sin(emb), torch.cos(emb)], dim=-1)
    if dim % 2 == 1:
        emb = F.pad(emb, (0, 1))
    return emb


class Ideogram4EmbedScalar(nn.Module):
    """Sinusoidal scalar embedding followed by a small MLP."""

    def __init__(self, dim, input_range):
        super().__init__()
        self.dim = dim
        self.range_min, self.range_max = input_range
        self.mlp_in = nn.Linear(dim, dim, bias=True)
        self.mlp_out = nn.Linear(dim, dim, bias=True)

    def forward(self, x):
        in_dtype = x.dtype
        x = x.to(torch.float32)
        scaled = 1e4 * (x - self.range_min) / (self.range_max - self.range_min)
        emb = _sinusoidal_embedding(scaled, self.dim)
        emb = emb.to(in_dtype)
        emb = F.silu(self.mlp_in(emb))
        return self.mlp_out(emb)


class Ideogram4FinalLayer(nn.Module):
    def __init__(self, hidden_size, out_channels, adaln_dim):
        super().__init__()
        self.norm_final = nn.LayerNorm(hidden_size, eps=1e-6, elementwise_affine=False)
        self.linear = nn.Linear(hidden_size, out_channels, bias=True)
        self.adaln_modulation = nn.Linear(adaln_dim, hidden_size, bias=True)

    def forward(self, hidden_states, conditioning):
        scale = 1.0 + self.adaln_modulation(F.silu(conditioning))
        return self.linear(self.norm_final(hidden_states) * scale)


class Ideogram4Transformer2DModel(nn.Module):
    def __init__(self, in_channels=128, num_layers=34, attention_head_dim=256, num_attention_heads=18,
                 intermediate_size=12288, adaln_dim=512, llm_features_dim=53248, rope_theta=5_000_000,
                 mrope_section=(24, 20, 20), norm_eps=1e-5):
        super().__init__()
        self.config = SimpleNamespace(in_channels=in_channels, num_layers=num_layers,
                                      attention_head_dim=attention_head_dim, num_attention_heads=num_attention_heads,
                                      llm_features_dim=llm_features_dim, rope_theta=rope_theta,
                                      mrope_section=mrope_section)
        hidden_size = attention_head_dim * num_attention_heads
        head_dim = attention_head_dim

        self.in_channels = in_channels
        self.out_channels = in_channels
        self.hidden_size = hidden_size
        self.gradient_checkpointing = False

        self.input_proj = nn.Linear(in_channels, hidden_size, bias=True)
        self.llm_cond_norm = RMSNorm(llm_features_dim, eps=1e-6, elementwise_affine=True)
        self.llm_cond_proj = nn.Linear(llm_features_dim, hidden_size, bias=True)
        self.t_embedding = Ideogram4EmbedScalar(hidden_size, input_range=(0.0, 1.0))
        self.adaln_proj = nn.Linear(hidden_size, adaln_dim, bias=True)
        self.embed_image_indicator = nn.Embedding(2, hidden_size)
        self.rotary_emb = Ideogram4MRoPE(head_dim=head_dim, base=rope_theta, mrope_section=mrope_section)
        self.layers = nn.ModuleList(
            [
                Ideogram4TransformerBlock(hidden_size=hidden_size, intermediate_size=intermediate_size,
                                          num_heads=num_attention_heads, norm_eps=norm_eps, adaln_dim=adaln_dim)
                for _ in range(num_layers)
            ]
        )
        self.final_layer = Ideogram4FinalLayer(hidden_size=hidden_size, out_channels=in_channels, adaln_dim=adaln_dim)

    def forward(self, hidden_states, timestep, encoder_hidden_states, position_ids, segment_ids, indicator,
                attention_kwargs=None, return_dict=True):
        batch_size, seq_len, in_channels = hidden_states.shape
        if in_channels != self.in_channels:
            raise ValueError(f"Expected last dim {self.in_channels}, got {in_channels}.")

        llm_token_mask = (indicator == LLM_TOKEN_INDICATOR).to(hidden_states.dtype).unsqueeze(-1)
        output_image_mask = (indicator == OUTPUT_IMAGE_INDICATOR).to(hidden_states.dtype).unsqueeze(-1)

        encoder_hidden_states = encoder_hidden_states * llm_token_mask
        hidden_states = hidden_states * output_image_mask
        hidden_states = self.input_proj(hidden_states) * output_image_mask

        t_cond = self.t_embedding(timestep)
        if timestep.dim() == 1:
            t_cond = t_cond.unsqueeze(1)
        adaln_input = F.silu(self.adaln_proj(t_cond))

        encoder_hidden_states = self.llm_cond_norm(encoder_hidden_states)
        encoder_hidden_states = self.llm_cond_proj(encoder_hidden_states) * llm_token_mask

        hidden_states = hidden_states + encoder_hidden_states

        image_indicator_embedding = self.embed_image_indicator((indicator == OUTPUT_IMAGE_INDICATOR).to(torch.long))
        hidden_states = hidden_states + image_indicator_embedding

        cos, sin = self.rotary_emb(position_ids)
        cos = cos.to(hidden_states.dtype)
        sin = sin.to(hidden_states.dtype)
        image_rotary_emb = (cos, sin)

        # Block-diagonal mask from segment ids: tokens only attend within their segment. Shared by every block.
        attention_mask = (segment_ids.unsqueeze(2) == segment_ids.unsqueeze(1)).unsqueeze(1)

        for block in self.layers:
            hidden_states = block(hidden_states, attention_mask, image_rotary_emb, adaln_input)

        output = self.final_layer(hidden_states, conditioning=adaln_input)
        return (output,)


def _prepare_ids(text_lengths, grid_h, grid_w, max_text_tokens, device):
    """Ideogram4Pipeline._prepare_ids: the packed `[left-pad][text][image]` layout."""
    batch_size = len(text_lengths)
    num_image_tokens = grid_h * grid_w
    total_seq_len = max_text_tokens + num_image_tokens

    # Image position ids (t=0, h, w); offset keeps them disjoint from text positions.
    h_idx = torch.arange(grid_h).view(-1, 1).expand(grid_h, grid_w).reshape(-1)
    w_idx = torch.arange(grid_w).view(1, -1).expand(grid_h, grid_w).reshape(-1)
    t_idx = torch.zeros_like(h_idx)
    image_pos = torch.stack([t_idx, h_idx, w_idx], dim=1) + IMAGE_POSITION_OFFSET

    position_ids = torch.zeros(batch_size, total_seq_len, 3, dtype=torch.long)
    segment_ids = torch.full((batch_size, total_seq_len), SEQUENCE_PADDING_INDICATOR, dtype=torch.long)
    indicator = torch.zeros(batch_size, total_seq_len, dtype=torch.long)

    for b, num_text in enumerate(text_lengths):
        offset = max_text_tokens - num_text

        text_pos = torch.arange(num_text)
        text_pos_3d = torch.stack([text_pos, text_pos, text_pos], dim=1)
        position_ids[b, offset : offset + num_text] = text_pos_3d
        position_ids[b, offset + num_text :] = image_pos

        indicator[b, offset : offset + num_text] = LLM_TOKEN_INDICATOR
        indicator[b, offset + num_text :] = OUTPUT_IMAGE_INDICATOR

        segment_ids[b, offset : offset + num_text + num_image_tokens] = 1

    return position_ids.to(device), segment_ids.to(device), indicator.to(device)


def main():
    device = torch.device("cpu")
    transformer = Ideogram4Transformer2DModel(
        in_channels=8, num_layers=2, attention_head_dim=32, num_attention_heads=2, intermediate_size=128,
        adaln_dim=32, llm_features_dim=24, rope_theta=5_000_000, mrope_section=(6, 5, 5),
    )
    optimizer = torch.optim.AdamW(transformer.parameters(), lr=1e-3)

    # two captions, left-padded to max_sequence_length; a 6x6 latent grid of packed patches
    max_sequence_length = 8
    text_lengths = [5, 8]
    grid_h, grid_w = 6, 6
    num_image_tokens = grid_h * grid_w
    batch_size = len(text_lengths)

    position_ids, segment_ids, indicator = _prepare_ids(text_lengths, grid_h, grid_w, max_sequence_length, device)

    text_features = torch.randn(batch_size, max_sequence_length, 24)
    attention_mask = torch.zeros(batch_size, max_sequence_length)
    for b, n in enumerate(text_lengths):
        attention_mask[b, max_sequence_length - n :] = 1
    text_features = text_features * attention_mask.unsqueeze(-1)
    llm_features = torch.cat([text_features, torch.zeros(batch_size, num_image_tokens, 24)], dim=1)

    # clean latents with spatial structure: a smooth ramp over the grid plus noise
    hh, ww = torch.meshgrid(torch.linspace(-1, 1, grid_h), torch.linspace(-1, 1, grid_w), indexing="ij")
    x0 = torch.stack([hh, ww, hh * ww, hh - ww] * 2, dim=-1).reshape(1, num_image_tokens, 8).repeat(batch_size, 1, 1)
    x0 = x0 + 0.1 * torch.randn_like(x0)

    # one flow-matching training step under bf16 autocast (model time: 0 = noise, 1 = data)
    noise = torch.randn_like(x0)
    t_model = torch.tensor([0.3, 0.7])
    z_t = (1.0 - t_model[:, None, None]) * noise + t_model[:, None, None] * x0
    target_v = x0 - noise
    text_z_padding = torch.zeros(batch_size, max_sequence_length, 8)
    pos_z = torch.cat([text_z_padding, z_t], dim=1)

    transformer.train()
    with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
        out = transformer(
            hidden_states=pos_z,
            timestep=t_model,
            encoder_hidden_states=llm_features,
            position_ids=position_ids,
            segment_ids=segment_ids,
            indicator=indicator,
            return_dict=False,
        )[0]
        pred_v = out[:, max_sequence_length:].float()
        loss = F.mse_loss(pred_v, target_v)
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(transformer.parameters(), 1e9)
    optimizer.step()
    optimizer.zero_grad()

    per_token = pred_v[0, :, 0]
    print("loss", round(loss.item(), 6))
    print("grad_norm", round(grad_norm.item(), 6))
    print("pred_v[0, :6, 0]", [round(v, 4) for v in per_token[:6].tolist()])
    print("std of pred_v[0, :, 0] over image tokens", round(per_token.std().item(), 6))


if __name__ == "__main__":
    main()
