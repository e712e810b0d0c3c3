# huggingface/diffusers#10548 (commit 4a4afd5ece, "Fix batch > 1 in HunyuanVideo"), a regression from
# huggingface/diffusers#10482 (commit 01bd79649e).
#
# HunyuanVideoTransformer3DModel.forward joins the latent tokens and the (right-padded) LLaMA prompt tokens into
# one sequence and builds a boolean key mask [B, N] that keeps the latents and each prompt's real tokens.
# #10482 shrank the old [B, N, N] mask to [B, N] and handed it to the attention processor as
# `attention_mask.unsqueeze(1)`, i.e. [B, 1, N]. HunyuanVideoAttnProcessor2_0 passes it to
# F.scaled_dot_product_attention next to query [B, heads, N, D]; SDPA lines a 3-D mask up from the right, so the
# batch axis of the mask meets the heads axis of the scores: head h of every sample uses sample h's prompt length.
# With as many heads as samples nothing fails. #10548 unsqueezes twice ([B, 1, 1, N]).
#
# Trimmed port: one dual-stream block (latent / context projections, QK RMSNorm, joint SDPA) and one single-stream
# block, as the model's forward calls them; patch embedding, RoPE and modulation are left out.
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


class Attention(nn.Module):
    # diffusers.models.attention_processor.Attention, the fields HunyuanVideoAttnProcessor2_0 reads
    def __init__(self, query_dim, heads, dim_head, added_kv_proj_dim=None):
        super().__init__()
        inner = heads * dim_head
        self.heads = heads
        self.to_q = nn.Linear(query_dim, inner)
        self.to_k = nn.Linear(query_dim, inner)
        self.to_v = nn.Linear(query_dim, inner)
        self.norm_q = nn.RMSNorm(dim_head, eps=1e-6)
        self.norm_k = nn.RMSNorm(dim_head, eps=1e-6)
        if added_kv_proj_dim is not None:
            self.add_q_proj = nn.Linear(added_kv_proj_dim, inner)
            self.add_k_proj = nn.Linear(added_kv_proj_dim, inner)
            self.add_v_proj = nn.Linear(added_kv_proj_dim, inner)
            self.norm_added_q = nn.RMSNorm(dim_head, eps=1e-6)
            self.norm_added_k = nn.RMSNorm(dim_head, eps=1e-6)
            self.to_out = nn.ModuleList([nn.Linear(inner, query_dim), nn.Dropout(0.0)])
            self.to_add_out = nn.Linear(inner, query_dim)
        else:
            self.add_q_proj = None
            self.norm_added_q = self.norm_added_k = None
            self.to_out = None
        self.processor = HunyuanVideoAttnProcessor2_0()

    def forward(self, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None):
        return self.processor(self, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb)


class HunyuanVideoAttnProcessor2_0:
    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None):
        if attn.add_q_proj is None and encoder_hidden_states is not None:
            hidden_states = torch.cat([hidden_states, encoder_hidden_states], dim=1)

        # 1. QKV projections
        query = attn.to_q(hidden_states)
        key = attn.to_k(hidden_states)
        value = attn.to_v(hidden_states)

        query = query.unflatten(2, (attn.heads, -1)).transpose(1, 2)
        key = key.unflatten(2, (attn.heads, -1)).transpose(1, 2)
        value = value.unflatten(2, (attn.heads, -1)).transpose(1, 2)

        # 2. QK normalization
        if attn.norm_q is not None:
            query = attn.norm_q(query)
        if attn.norm_k is not None:
            key = attn.norm_k(key)

        # 4. Encoder condition QKV projection and normalization
        if attn.add_q_proj is not None and encoder_hidden_states is not None:
            encoder_query = attn.add_q_proj(encoder_hidden_states)
            encoder_key = attn.add_k_proj(encoder_hidden_states)
            encoder_value = attn.add_v_proj(encoder_hidden_states)

            encoder_query = encoder_query.unflatten(2, (attn.heads, -1)).transpose(1, 2)
            encoder_key = encoder_key.unflatten(2, (attn.heads, -1)).transpose(1, 2)
            encoder_value = encoder_value.unflatten(2, (attn.heads, -1)).transpose(1, 2)

            if attn.norm_added_q is not None:
                encoder_query = attn.norm_added_q(encoder_query)
            if attn.norm_added_k is not None:
                encoder_key = attn.norm_added_k(encoder_key)

            query = torch.cat([query, encoder_query], dim=2)
            key = torch.cat([key, encoder_key], dim=2)
            value = torch.cat([value, encoder_value], dim=2)

        # 5. Attention
        hidden_states = F.scaled_dot_product_attention(
            query, key, value, attn_mask=attention_mask, dropout_p=0.0, is_causal=False
        )
        hidden_states = hidden_states.transpose(1, 2).flatten(2, 3)
        hidden_states = hidden_states.to(query.dtype)

        # 6. Output projection
        if encoder_hidden_states is not None:
            hidden_states, encoder_hidden_states = (
                hidden_states[:, : -encoder_hidden_states.shape[1]],
                hidden_states[:, -encoder_hidden_states.shape[1] :],
            )
            if getattr(attn, "to_out", None) is not None:
                hidden_states = attn.to_out[0](hidden_states)
                hidden_states = attn.to_out[1](hidden_states)
            if getattr(attn, "to_add_out", None) is not None:
                encoder_hidden_states = attn.to_add_out(encoder_hidden_states)

        return hidden_states, encoder_hidden_states


class HunyuanVideoTransformerBlock(nn.Module):
    def __init__(self, num_attention_heads, attention_head_dim):
        super().__init__()
        dim = num_attention_heads * attention_head_dim
        self.norm1 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.norm1_context = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.attn = Attention(dim, num_attention_heads, attention_head_dim, added_kv_proj_dim=dim)
        self.ff = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(approximate="tanh"), nn.Linear(4 * dim, dim))
        self.ff_context = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(approximate="tanh"), nn.Linear(4 * dim, dim))

    def forward(self, hidden_states, encoder_hidden_states, temb, attention_mask=None, freqs_cis=None):
        norm_hidden_states = self.norm1(hidden_states) + temb[:, None]
        norm_encoder_hidden_states = self.norm1_context(encoder_hidden_states) + temb[:, None]
        attn_output, context_attn_output = self.attn(
            hidden_states=norm_hidden_states,
            encoder_hidden_states=norm_encoder_hidden_states,
            attention_mask=attention_mask,
            image_rotary_emb=freqs_cis,
        )
        hidden_states = hidden_states + attn_output
        encoder_hidden_states = encoder_hidden_states + context_attn_output
        hidden_states = hidden_states + self.ff(hidden_states)
        encoder_hidden_states = encoder_hidden_states + self.ff_context(encoder_hidden_states)
        return hidden_states, encoder_hidden_states


class HunyuanVideoSingleTransformerBlock(nn.Module):
    def __init__(self, num_attention_heads, attention_head_dim):
        super().__init__()
        dim = num_attention_heads * attention_head_dim
        self.norm = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.attn = Attention(dim, num_attention_heads, attention_head_dim)
        self.proj_mlp = nn.Linear(dim, 4 * dim)
        self.proj_out = nn.Linear(dim + 4 * dim, dim)

    def forward(self, hidden_states, encoder_hidden_states, temb, attention_mask=None, image_rotary_emb=None):
        text_seq_length = encoder_hidden_states.shape[1]
        hidden_states = torch.cat([hidden_states, encoder_hidden_states], dim=1)
        residual = hidden_states
        norm_hidden_states = self.norm(hidden_states) + temb[:, None]
        mlp_hidden_states = F.gelu(self.proj_mlp(norm_hidden_states), approximate="tanh")
        norm_hidden_states, norm_encoder_hidden_states = (
            norm_hidden_states[:, :-text_seq_length, :],
            norm_hidden_states[:, -text_seq_length:, :],
        )
        attn_output, context_attn_output = self.attn(
            hidden_states=norm_hidden_states,
            encoder_hidden_states=norm_encoder_hidden_states,
            attention_mask=attention_mask,
            image_rotary_emb=image_rotary_emb,
        )
        attn_output = torch.cat([attn_output, context_attn_output], dim=1)
        hidden_states = torch.cat([attn_output, mlp_hidden_states], dim=2)
        hidden_states = self.proj_out(hidden_states) + residual
        hidden_states, encoder_hidden_states = (
            hidden_states[:, :-text_seq_length, :],
            hidden_states[:, -text_seq_length:, :],
        )
        return hidden_states, encoder_hidden_states


class HunyuanVideoTransformer3DModel(nn.Module):
    def __init__(self, in_channels=4, num_attention_heads=2, attention_head_dim=8, text_embed_dim=12):
        super().__init__()
        inner_dim = num_attention_heads * attention_head_dim
        self.x_embedder = nn.Linear(in_channels, inner_dim)  # stands in for HunyuanVideoPatchEmbed
        self.context_embedder = nn.Linear(text_embed_dim, inner_dim)  # stands in for HunyuanVideoTokenRefiner
        self.time_text_embed = nn.Linear(1, inner_dim)
        self.transformer_blocks = nn.ModuleList([HunyuanVideoTransformerBlock(num_attention_heads, attention_head_dim)])
        self.single_transformer_blocks = nn.ModuleList(
            [HunyuanVideoSingleTransformerBlock(num_attention_heads, attention_head_dim)]
        )
        self.proj_out = nn.Linear(inner_dim, in_channels)

    def forward(self, hidden_states, timestep, encoder_hidden_states, encoder_attention_mask):
        batch_size, num_channels, num_frames, height, width = hidden_states.shape
        image_rotary_emb = None

        # 2. Conditional embeddings
        temb = self.time_text_embed(timestep[:, None])
        hidden_states = self.x_embedder(hidden_states.flatten(2).transpose(1, 2))
        encoder_hidden_states = self.context_embedder(encoder_hidden_states)

        # 3. Attention mask preparation
        latent_sequence_length = hidden_states.shape[1]
        condition_sequence_length = encoder_hidden_states.shape[1]
        sequence_length = latent_sequence_length + condition_sequence_length
        attention_mask = torch.zeros(
            batch_size, sequence_length, device=hidden_states.device, dtype=torch.bool
        )  # [B, N]

        effective_condition_sequence_length = encoder_attention_mask.sum(dim=1, dtype=torch.int)  # [B,]
        effective_sequence_length = latent_sequence_length + effective_condition_sequence_length

        for i in range(batch_size):
            attention_mask[i, : effective_sequence_length[i]] = True
        if FIXED:
            # [B, 1, 1, N], for broadcasting across attention heads
            attention_mask = attention_mask.unsqueeze(1).unsqueeze(1)
        else:
            attention_mask = attention_mask.unsqueeze(1)  # [B, 1, N], for broadcasting across attention heads

        # 4. Transformer blocks
        for block in self.transformer_blocks:
            hidden_states, encoder_hidden_states = block(
                hidden_states, encoder_hidden_states, temb, attention_mask, image_rotary_emb
            )
        for block in self.single_transformer_blocks:
            hidden_states, encoder_hidden_states = block(
                hidden_states, encoder_hidden_states, temb, attention_mask, image_rotary_emb
            )

        # 5. Output projection
        hidden_states = self.proj_out(hidden_states)
        return hidden_states.transpose(1, 2).reshape(batch_size, num_channels, num_frames, height, width)


def main():
    torch.manual_seed(0)
    model = HunyuanVideoTransformer3DModel().eval()

    # Two prompts, right-padded by the LLaMA tokenizer to max_sequence_length = 8 (3 and 7 real tokens), as
    # HunyuanVideoPipeline._get_llama_prompt_embeds returns them.
    prompt_embeds = torch.randn(2, 8, 12)
    prompt_attention_mask = torch.tensor([[1, 1, 1, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1, 1, 0]])
    prompt_embeds = prompt_embeds * prompt_attention_mask[..., None]
    latents = torch.randn(2, 4, 2, 2, 2)  # [B, C, F, H, W] after patchify: 8 latent tokens
    timestep = torch.tensor([0.5, 0.5])

    with torch.no_grad():
        noise_pred = model(latents, timestep, prompt_embeds, prompt_attention_mask)
    print("noise_pred[0, :, 0, 0, 0]", [round(v, 5) for v in noise_pred[0, :, 0, 0, 0].tolist()])
    print("noise_pred[1, :, 0, 0, 0]", [round(v, 5) for v in noise_pred[1, :, 0, 0, 0].tolist()])
    print("noise_pred norm", round(noise_pred.norm().item(), 5))


if __name__ == "__main__":
    main()
