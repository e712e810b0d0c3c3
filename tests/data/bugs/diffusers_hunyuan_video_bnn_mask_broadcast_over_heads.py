"""HunyuanVideo transformer hands SDPA a [B, N, N] mask, which broadcasts over heads, not over the batch.

Citation: huggingface/diffusers#10454 (commit 7747b588e2, "Fix hunyuan video attention mask dim",
co-authored by Nerogar); diff read upstream.

Bug: ``HunyuanVideoTransformer3DModel.forward`` builds ``attention_mask`` of shape ``[B, N, N]`` over the
concatenated [latent tokens, text tokens] sequence (each sample sees its latents plus its own number of
real text tokens) and passes it to ``HunyuanVideoAttnProcessor2_0``, which calls
``F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask)`` with ``query`` of shape
``[B, heads, N, D]``. Broadcasting aligns the mask's leading dimension with the *heads* axis: head ``h``
of every sample uses the mask of sample ``h``. (With a batch other than 1 or ``heads`` this raises; when
the batch equals the number of heads it runs and silently gives samples each other's padding.)
Fix: ``attention_mask = attention_mask.unsqueeze(1)  # [B, 1, N, N]``.

This program keeps the mask preparation and one double-stream block with the attention processor's
layout (latents first, text appended). The model has 2 heads and runs a batch of 2 prompts whose
``encoder_attention_mask`` holds 2 and 5 real tokens of 6, over 4 latent tokens.
"""
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


class Attention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.to_q, self.to_k, self.to_v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.add_q_proj, self.add_k_proj, self.add_v_proj = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.to_out, self.to_add_out = nn.Linear(dim, dim), nn.Linear(dim, dim)


class HunyuanVideoAttnProcessor2_0:
    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None):
        query = attn.to_q(hidden_states).unflatten(2, (attn.heads, -1)).transpose(1, 2)
        key = attn.to_k(hidden_states).unflatten(2, (attn.heads, -1)).transpose(1, 2)
        value = attn.to_v(hidden_states).unflatten(2, (attn.heads, -1)).transpose(1, 2)

        encoder_query = attn.add_q_proj(encoder_hidden_states).unflatten(2, (attn.heads, -1)).transpose(1, 2)
        encoder_key = attn.add_k_proj(encoder_hidden_states).unflatten(2, (attn.heads, -1)).transpose(1, 2)
        encoder_value = attn.add_v_proj(encoder_hidden_states).unflatten(2, (attn.heads, -1)).transpose(1, 2)

        query = torch.cat([query, encoder_query], dim=2)
        key = torch.cat([key, encoder_key], dim=2)
        value = torch.cat([value, encoder_value], dim=2)

        # 5. Attention
        hidden_states = F.scaled_dot_product_attention(
            query, key, value, attn_mask=attention_mask, dropout_p=0.0, is_causal=False
        )
        hidden_states = hidden_states.transpose(1, 2).flatten(2, 3)

        hidden_states, encoder_hidden_states = (
            hidden_states[:, : -encoder_hidden_states.shape[1]],
            hidden_states[:, -encoder_hidden_states.shape[1]:],
        )
        return attn.to_out(hidden_states), attn.to_add_out(encoder_hidden_states)


class HunyuanVideoTransformerBlock(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.norm1_context = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.attn = Attention(dim, heads)
        self.processor = HunyuanVideoAttnProcessor2_0()

    def forward(self, hidden_states, encoder_hidden_states, temb, attention_mask=None):
        attn_output, context_attn_output = self.processor(
            self.attn, self.norm1(hidden_states), self.norm1_context(encoder_hidden_states), attention_mask
        )
        return hidden_states + attn_output, encoder_hidden_states + context_attn_output


class HunyuanVideoTransformer3DModel(nn.Module):
    def __init__(self, in_channels=8, text_embed_dim=16, num_attention_heads=2, attention_head_dim=8, num_layers=2):
        super().__init__()
        inner_dim = num_attention_heads * attention_head_dim
        self.x_embedder = nn.Linear(in_channels, inner_dim)
        self.context_embedder = nn.Linear(text_embed_dim, inner_dim)
        self.transformer_blocks = nn.ModuleList(
            [HunyuanVideoTransformerBlock(inner_dim, num_attention_heads) for _ in range(num_layers)]
        )

    def forward(self, hidden_states, timestep, encoder_hidden_states, encoder_attention_mask):
        batch_size = hidden_states.shape[0]
        temb = timestep
        hidden_states = self.x_embedder(hidden_states)
        encoder_hidden_states = self.context_embedder(encoder_hidden_states)

        # 3. Attention mask preparation
        latent_sequence_length = hidden_states.shape[1]
        condition_sequence_length = encoder_hidden_states.shape[1]
        sequence_length = latent_sequence_length + condition_sequence_length
        attention_mask = torch.zeros(
            batch_size, sequence_length, sequence_length, device=hidden_states.device, dtype=torch.bool
        )  # [B, N, N]

        effective_condition_sequence_length = encoder_attention_mask.sum(dim=1, dtype=torch.int)  # [B,]
        effective_sequence_length = latent_sequence_length + effective_condition_sequence_length

        for i in range(batch_size):
            attention_mask[i, : effective_sequence_length[i], : effective_sequence_length[i]] = True
        if FIXED:
            attention_mask = attention_mask.unsqueeze(1)  # [B, 1, N, N], for broadcasting across attention heads

        # 4. Transformer blocks
        for block in self.transformer_blocks:
            hidden_states, encoder_hidden_states = block(hidden_states, encoder_hidden_states, temb, attention_mask)
        return hidden_states


def main():
    torch.manual_seed(0)
    model = HunyuanVideoTransformer3DModel().eval()
    latents = torch.randn(2, 4, 8)  # 4 patchified latent tokens per video
    prompt_embeds = torch.randn(2, 6, 16)
    encoder_attention_mask = torch.tensor([[1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 1, 0]])
    with torch.no_grad():
        out = model(latents, torch.zeros(2), prompt_embeds, encoder_attention_mask)
    print("latent out", tuple(out.shape), "out[0,0,:3]", [round(v, 4) for v in out[0, 0, :3].tolist()])


if __name__ == "__main__":
    main()
