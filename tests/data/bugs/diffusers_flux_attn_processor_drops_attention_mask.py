"""Flux joint attention accepts ``attention_mask`` through ``joint_attention_kwargs`` but never uses it.

Citation: huggingface/diffusers#11065 (commit 6b9a3334db, "reverts accidental change that removes attn_mask
in attn ..."), which restores the mask that huggingface/diffusers#10122 ("pass attn mask arg for flux")
had wired into ``FluxAttnProcessor2_0``; diff read upstream.

Bug: after the accidental change, ``FluxAttnProcessor2_0.__call__`` still takes ``attention_mask`` (the
transformer forwards it from ``joint_attention_kwargs``) but calls
``F.scaled_dot_product_attention(query, key, value, dropout_p=0.0, is_causal=False)`` without it, so a
caller's mask hiding T5 padding in the joint [text, image] sequence has no effect.
Fix: ``F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=0.0,
is_causal=False)``.

This program keeps the processor as it was (text first, then image; rotary embedding omitted) in one
double-stream block, and builds the caller's mask the way masked-Flux users do: the T5 tokenizer's
attention mask for the text tokens, ones for the image tokens, as ``[B, 1, 1, txt + img]`` booleans passed
in ``joint_attention_kwargs``. Two prompts with 3 and 7 real tokens of 8, over 4 packed latent tokens.
"""
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


class Attention(nn.Module):
    def __init__(self, query_dim, heads, dim_head):
        super().__init__()
        inner_dim = heads * dim_head
        self.heads = heads
        self.to_q, self.to_k, self.to_v = (nn.Linear(query_dim, inner_dim) for _ in range(3))
        self.add_q_proj, self.add_k_proj, self.add_v_proj = (nn.Linear(query_dim, inner_dim) for _ in range(3))
        self.norm_q = self.norm_k = self.norm_added_q = self.norm_added_k = None
        self.to_out = nn.ModuleList([nn.Linear(inner_dim, query_dim), nn.Dropout(0.0)])
        self.to_add_out = nn.Linear(inner_dim, query_dim)
        self.processor = FluxAttnProcessor2_0()

    def forward(self, hidden_states, encoder_hidden_states=None, **cross_attention_kwargs):
        return self.processor(self, hidden_states, encoder_hidden_states, **cross_attention_kwargs)


class FluxAttnProcessor2_0:
    """Attention processor used typically in processing the SD3-like self-attention projections."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None):
        batch_size, _, _ = hidden_states.shape if encoder_hidden_states is None else encoder_hidden_states.shape

        # `sample` projections.
        query = attn.to_q(hidden_states)
        key = attn.to_k(hidden_states)
        value = attn.to_v(hidden_states)

        inner_dim = key.shape[-1]
        head_dim = inner_dim // attn.heads

        query = query.view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)
        key = key.view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)
        value = value.view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)

        # the attention in FluxSingleTransformerBlock does not use `encoder_hidden_states`
        if encoder_hidden_states is not None:
            # `context` projections.
            encoder_hidden_states_query_proj = attn.add_q_proj(encoder_hidden_states).view(
                batch_size, -1, attn.heads, head_dim).transpose(1, 2)
            encoder_hidden_states_key_proj = attn.add_k_proj(encoder_hidden_states).view(
                batch_size, -1, attn.heads, head_dim).transpose(1, 2)
            encoder_hidden_states_value_proj = attn.add_v_proj(encoder_hidden_states).view(
                batch_size, -1, attn.heads, head_dim).transpose(1, 2)

            # attention
            query = torch.cat([encoder_hidden_states_query_proj, query], dim=2)
            key = torch.cat([encoder_hidden_states_key_proj, key], dim=2)
            value = torch.cat([encoder_hidden_states_value_proj, value], dim=2)

        if FIXED:
            hidden_states = F.scaled_dot_product_attention(
                query, key, value, attn_mask=attention_mask, dropout_p=0.0, is_causal=False
            )
        else:
            hidden_states = F.scaled_dot_product_attention(query, key, value, dropout_p=0.0, is_causal=False)

        hidden_states = hidden_states.transpose(1, 2).reshape(batch_size, -1, attn.heads * head_dim)
        hidden_states = hidden_states.to(query.dtype)

        if encoder_hidden_states is not None:
            encoder_hidden_states, hidden_states = (
                hidden_states[:, : encoder_hidden_states.shape[1]],
                hidden_states[:, encoder_hidden_states.shape[1]:],
            )
            hidden_states = attn.to_out[1](attn.to_out[0](hidden_states))
            encoder_hidden_states = attn.to_add_out(encoder_hidden_states)
            return hidden_states, encoder_hidden_states
        return hidden_states


class FluxTransformerBlock(nn.Module):
    def __init__(self, dim, num_attention_heads, attention_head_dim):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.norm1_context = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.attn = Attention(query_dim=dim, heads=num_attention_heads, dim_head=attention_head_dim)

    def forward(self, hidden_states, encoder_hidden_states, joint_attention_kwargs=None):
        joint_attention_kwargs = joint_attention_kwargs or {}
        attn_output, context_attn_output = self.attn(
            hidden_states=self.norm1(hidden_states),
            encoder_hidden_states=self.norm1_context(encoder_hidden_states),
            **joint_attention_kwargs,
        )
        return hidden_states + attn_output, encoder_hidden_states + context_attn_output


def main():
    torch.manual_seed(0)
    block = FluxTransformerBlock(dim=16, num_attention_heads=2, attention_head_dim=8).eval()
    prompt_embeds = torch.randn(2, 8, 16)   # T5 embeddings, padding="max_length"
    latents = torch.randn(2, 4, 16)         # packed latents
    t5_attention_mask = torch.tensor([[1, 1, 1, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1, 1, 0]])

    attention_mask = torch.cat([t5_attention_mask, torch.ones(2, latents.shape[1], dtype=torch.long)], dim=1)
    attention_mask = attention_mask.bool()[:, None, None, :]

    with torch.no_grad():
        latents_out, _ = block(latents, prompt_embeds, joint_attention_kwargs={"attention_mask": attention_mask})
    print("latents", tuple(latents_out.shape), "latents[0,0,:3]", [round(v, 4) for v in latents_out[0, 0, :3].tolist()])


if __name__ == "__main__":
    main()
