# diffusers (huggingface/diffusers commit 128b96f, PR #10033 "Fix Mochi Quality Issues"): MochiAttnProcessor2_0
# concatenated the 256-padded T5 prompt tokens to the video tokens and ran joint SDPA with no mask, so every video
# token attended to the padding; the fix passes encoder_attention_mask and attends only each sample's valid tokens.
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class MochiRMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-5, elementwise_affine=True):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(1.0 + 0.1 * torch.randn(dim)) if elementwise_affine else None

    def forward(self, hidden_states):
        variance = hidden_states.to(torch.float32).pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.eps)
        if self.weight is not None:
            hidden_states = hidden_states * self.weight
        return hidden_states


class MochiAttention(nn.Module):
    def __init__(self, query_dim, added_kv_proj_dim, processor, heads=2, dim_head=16, bias=False,
                 added_proj_bias=True, out_bias=True, context_pre_only=False, eps=1e-5):
        super().__init__()
        self.inner_dim = dim_head * heads
        self.heads = heads
        self.context_pre_only = context_pre_only
        self.norm_q = MochiRMSNorm(dim_head, eps, True)
        self.norm_k = MochiRMSNorm(dim_head, eps, True)
        self.norm_added_q = MochiRMSNorm(dim_head, eps, True)
        self.norm_added_k = MochiRMSNorm(dim_head, eps, True)
        self.to_q = nn.Linear(query_dim, self.inner_dim, bias=bias)
        self.to_k = nn.Linear(query_dim, self.inner_dim, bias=bias)
        self.to_v = nn.Linear(query_dim, self.inner_dim, bias=bias)
        self.add_k_proj = nn.Linear(added_kv_proj_dim, self.inner_dim, bias=added_proj_bias)
        self.add_v_proj = nn.Linear(added_kv_proj_dim, self.inner_dim, bias=added_proj_bias)
        self.add_q_proj = nn.Linear(added_kv_proj_dim, self.inner_dim, bias=added_proj_bias)
        self.to_out = nn.ModuleList([nn.Linear(self.inner_dim, query_dim, bias=out_bias), nn.Dropout(0.0)])
        if not self.context_pre_only:
            self.to_add_out = nn.Linear(self.inner_dim, added_kv_proj_dim, bias=out_bias)
        self.processor = processor

    def forward(self, hidden_states, encoder_hidden_states=None, attention_mask=None, **kwargs):
        return self.processor(self, hidden_states, encoder_hidden_states=encoder_hidden_states,
                              attention_mask=attention_mask, **kwargs)


def apply_rotary_emb(x, freqs_cos, freqs_sin):
    x_even = x[..., 0::2].float()
    x_odd = x[..., 1::2].float()
    cos = (x_even * freqs_cos - x_odd * freqs_sin).to(x.dtype)
    sin = (x_even * freqs_sin + x_odd * freqs_cos).to(x.dtype)
    return torch.stack([cos, sin], dim=-1).flatten(-2)


class MochiAttnProcessor2_0:
    """Attention processor used in Mochi."""

    def __call__(self, attn, hidden_states, encoder_hidden_states, attention_mask=None, image_rotary_emb=None):
        query = attn.to_q(hidden_states).unflatten(2, (attn.heads, -1))
        key = attn.to_k(hidden_states).unflatten(2, (attn.heads, -1))
        value = attn.to_v(hidden_states).unflatten(2, (attn.heads, -1))
        query = attn.norm_q(query)
        key = attn.norm_k(key)

        encoder_query = attn.add_q_proj(encoder_hidden_states).unflatten(2, (attn.heads, -1))
        encoder_key = attn.add_k_proj(encoder_hidden_states).unflatten(2, (attn.heads, -1))
        encoder_value = attn.add_v_proj(encoder_hidden_states).unflatten(2, (attn.heads, -1))
        encoder_query = attn.norm_added_q(encoder_query)
        encoder_key = attn.norm_added_k(encoder_key)

        if image_rotary_emb is not None:
            query = apply_rotary_emb(query, *image_rotary_emb)
            key = apply_rotary_emb(key, *image_rotary_emb)

        query, key, value = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
        encoder_query, encoder_key, encoder_value = (
            encoder_query.transpose(1, 2), encoder_key.transpose(1, 2), encoder_value.transpose(1, 2))

        sequence_length = query.size(2)
        encoder_sequence_length = encoder_query.size(2)

        if not FIXED:
            # before the fix: joint attention over all (padded) prompt tokens, no mask
            query = torch.cat([query, encoder_query], dim=2)
            key = torch.cat([key, encoder_key], dim=2)
            value = torch.cat([value, encoder_value], dim=2)
            hidden_states = F.scaled_dot_product_attention(query, key, value, dropout_p=0.0, is_causal=False)
            hidden_states = hidden_states.transpose(1, 2).flatten(2, 3)
            hidden_states = hidden_states.to(query.dtype)
        else:
            total_length = sequence_length + encoder_sequence_length
            batch_size, heads, _, dim = query.shape
            attn_outputs = []
            for idx in range(batch_size):
                mask = attention_mask[idx][None, :]
                valid_prompt_token_indices = torch.nonzero(mask.flatten(), as_tuple=False).flatten()
                valid_encoder_query = encoder_query[idx : idx + 1, :, valid_prompt_token_indices, :]
                valid_encoder_key = encoder_key[idx : idx + 1, :, valid_prompt_token_indices, :]
                valid_encoder_value = encoder_value[idx : idx + 1, :, valid_prompt_token_indices, :]
                valid_query = torch.cat([query[idx : idx + 1], valid_encoder_query], dim=2)
                valid_key = torch.cat([key[idx : idx + 1], valid_encoder_key], dim=2)
                valid_value = torch.cat([value[idx : idx + 1], valid_encoder_value], dim=2)
                attn_output = F.scaled_dot_product_attention(
                    valid_query, valid_key, valid_value, dropout_p=0.0, is_causal=False)
                valid_sequence_length = attn_output.size(2)
                attn_output = F.pad(attn_output, (0, 0, 0, total_length - valid_sequence_length))
                attn_outputs.append(attn_output)
            hidden_states = torch.cat(attn_outputs, dim=0)
            hidden_states = hidden_states.transpose(1, 2).flatten(2, 3)

        hidden_states, encoder_hidden_states = hidden_states.split_with_sizes(
            (sequence_length, encoder_sequence_length), dim=1)
        hidden_states = attn.to_out[0](hidden_states)
        hidden_states = attn.to_out[1](hidden_states)
        if hasattr(attn, "to_add_out"):
            encoder_hidden_states = attn.to_add_out(encoder_hidden_states)
        return hidden_states, encoder_hidden_states


class MochiTransformerBlock(nn.Module):
    def __init__(self, dim, pooled_projection_dim, heads, head_dim):
        super().__init__()
        self.norm1 = nn.Linear(dim, 4 * dim)  # MochiRMSNormZero: scale_msa, gate_msa, scale_mlp, gate_mlp
        self.norm1_context = nn.Linear(dim, 4 * pooled_projection_dim)
        self.attn1 = MochiAttention(dim, pooled_projection_dim, MochiAttnProcessor2_0(), heads=heads, dim_head=head_dim)
        self.ff = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(approximate="tanh"), nn.Linear(2 * dim, dim))
        self.ff_context = nn.Sequential(nn.Linear(pooled_projection_dim, 2 * pooled_projection_dim),
                                        nn.GELU(approximate="tanh"),
                                        nn.Linear(2 * pooled_projection_dim, pooled_projection_dim))
        self.rms = MochiRMSNorm(dim, elementwise_affine=False)
        self.rms_c = MochiRMSNorm(pooled_projection_dim, elementwise_affine=False)

    def forward(self, hidden_states, encoder_hidden_states, temb, encoder_attention_mask, image_rotary_emb=None):
        scale_msa, gate_msa, scale_mlp, gate_mlp = self.norm1(F.silu(temb)).chunk(4, dim=1)
        norm_hidden_states = self.rms(hidden_states) * (1 + scale_msa[:, None])
        e_scale_msa, e_gate_msa, e_scale_mlp, e_gate_mlp = self.norm1_context(F.silu(temb)).chunk(4, dim=1)
        norm_encoder_hidden_states = self.rms_c(encoder_hidden_states) * (1 + e_scale_msa[:, None])

        attn_kwargs = dict(hidden_states=norm_hidden_states, encoder_hidden_states=norm_encoder_hidden_states,
                           image_rotary_emb=image_rotary_emb)
        if FIXED:
            attn_kwargs["attention_mask"] = encoder_attention_mask
        attn_hidden_states, context_attn_hidden_states = self.attn1(**attn_kwargs)

        hidden_states = hidden_states + self.rms(attn_hidden_states) * torch.tanh(gate_msa).unsqueeze(1)
        ff_output = self.ff(self.rms(hidden_states) * (1 + scale_mlp.unsqueeze(1)))
        hidden_states = hidden_states + self.rms(ff_output) * torch.tanh(gate_mlp).unsqueeze(1)

        encoder_hidden_states = encoder_hidden_states + self.rms_c(context_attn_hidden_states) * torch.tanh(
            e_gate_msa).unsqueeze(1)
        c_ff = self.ff_context(self.rms_c(encoder_hidden_states) * (1 + e_scale_mlp.unsqueeze(1)))
        encoder_hidden_states = encoder_hidden_states + self.rms_c(c_ff) * torch.tanh(e_gate_mlp).unsqueeze(1)
        return hidden_states, encoder_hidden_states


class TinyMochiTransformer(nn.Module):
    def __init__(self, in_ch=4, dim=32, text_dim=24, heads=2, head_dim=16, layers=2):
        super().__init__()
        self.patch = nn.Linear(in_ch, dim)
        self.caption_proj = nn.Linear(text_dim, text_dim)
        self.t_embed = nn.Sequential(nn.Linear(1, dim), nn.SiLU(), nn.Linear(dim, dim))
        self.blocks = nn.ModuleList([MochiTransformerBlock(dim, text_dim, heads, head_dim) for _ in range(layers)])
        self.proj_out = nn.Linear(dim, in_ch)
        self.head_dim = head_dim

    def rope(self, n):
        pos = torch.arange(n, dtype=torch.float32)[:, None]
        inv = 1.0 / (10000 ** (torch.arange(0, self.head_dim, 2).float() / self.head_dim))
        freqs = (pos * inv)[:, None, :]  # (n, 1, head_dim/2)
        return torch.cos(freqs), torch.sin(freqs)

    def forward(self, hidden_states, encoder_hidden_states, timestep, encoder_attention_mask):
        x = self.patch(hidden_states)
        temb = self.t_embed(timestep[:, None].float())
        ctx = self.caption_proj(encoder_hidden_states)
        rot = self.rope(x.shape[1])
        for blk in self.blocks:
            x, ctx = blk(x, ctx, temb, encoder_attention_mask, image_rotary_emb=rot)
        return self.proj_out(x)


model = TinyMochiTransformer().eval()
B, N, L, TD = 2, 16, 12, 24
latents = torch.randn(B, N, 4)
prompt_embeds = torch.randn(B, L, TD)
lengths = [5, 9]
prompt_attention_mask = torch.zeros(B, L, dtype=torch.long)
for i, n in enumerate(lengths):
    prompt_attention_mask[i, :n] = 1
    prompt_embeds[i, n:] = 0.0  # T5 padding embeddings (still projected by add_k/add_v biases)
timestep = torch.tensor([500, 500])

with torch.no_grad():
    batched = model(latents, prompt_embeds, timestep, prompt_attention_mask)
    diffs = []
    for i, n in enumerate(lengths):
        ref = model(latents[i : i + 1], prompt_embeds[i : i + 1, :n], timestep[i : i + 1],
                    torch.ones(1, n, dtype=torch.long))
        diffs.append((batched[i : i + 1] - ref).abs().max().item())
print(f"max |padded-batch video output - unpadded per-prompt output| = {max(diffs):.3e}")
