"""SD3 MMDiT joint attention: the processor accepts ``attention_mask`` and ignores it; T5 padding is attended.

Follows huggingface/diffusers src/diffusers/models/attention_processor.py (JointAttnProcessor2_0.__call__ takes
attention_mask=None and never reads it: image and context q/k/v are concatenated and
F.scaled_dot_product_attention runs with is_causal=False and no mask), models/attention.py (JointTransformerBlock,
context_pre_only on the last block) and pipelines/stable_diffusion_3/pipeline_stable_diffusion_3.py
(_get_t5_prompt_embeds pads to max_sequence_length and calls the T5 encoder without the tokenizer's attention
mask). SD3 was trained this way: the padded T5 states are part of the conditioning, so attending to them is the
meaning, and the tokenizer mask is deliberately not passed down.
Mask meant: none -- full bidirectional attention over [image patches ; all 12 text slots] in every block.
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class Attention(nn.Module):
    def __init__(self, query_dim, heads, context_pre_only=False, processor=None):
        super().__init__()
        self.heads = heads
        self.context_pre_only = context_pre_only
        self.to_q, self.to_k, self.to_v = (nn.Linear(query_dim, query_dim) for _ in range(3))
        self.add_q_proj, self.add_k_proj, self.add_v_proj = (nn.Linear(query_dim, query_dim) for _ in range(3))
        self.to_out = nn.ModuleList([nn.Linear(query_dim, query_dim), nn.Dropout(0.0)])
        self.to_add_out = None if context_pre_only else nn.Linear(query_dim, query_dim)
        self.processor = processor

    def forward(self, hidden_states, encoder_hidden_states=None, attention_mask=None, **kwargs):
        return self.processor(self, hidden_states, encoder_hidden_states=encoder_hidden_states,
                              attention_mask=attention_mask, **kwargs)


class JointAttnProcessor2_0:
    """Attention processor used typically in processing the SD3-like self-attention projections."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, *args, **kwargs):
        residual = hidden_states
        batch_size = hidden_states.shape[0]
        query, key, value = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
        inner_dim = key.shape[-1]
        head_dim = inner_dim // attn.heads
        query = query.view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)
        key = key.view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)
        value = value.view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)
        if encoder_hidden_states is not None:
            eq = attn.add_q_proj(encoder_hidden_states).view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)
            ek = attn.add_k_proj(encoder_hidden_states).view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)
            ev = attn.add_v_proj(encoder_hidden_states).view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)
            query = torch.cat([query, eq], dim=2)
            key = torch.cat([key, ek], dim=2)
            value = torch.cat([value, ev], dim=2)
        hidden_states = F.scaled_dot_product_attention(query, key, value, dropout_p=0.0, is_causal=False)
        hidden_states = hidden_states.transpose(1, 2).reshape(batch_size, -1, attn.heads * head_dim)
        if encoder_hidden_states is not None:
            hidden_states, encoder_hidden_states = (
                hidden_states[:, : residual.shape[1]], hidden_states[:, residual.shape[1]:])
            if not attn.context_pre_only:
                encoder_hidden_states = attn.to_add_out(encoder_hidden_states)
        hidden_states = attn.to_out[1](attn.to_out[0](hidden_states))
        if encoder_hidden_states is not None:
            return hidden_states, encoder_hidden_states
        return hidden_states


class JointTransformerBlock(nn.Module):
    def __init__(self, dim, num_attention_heads, context_pre_only=False):
        super().__init__()
        self.context_pre_only = context_pre_only
        self.norm1, self.norm1_context = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = Attention(dim, num_attention_heads, context_pre_only, processor=JointAttnProcessor2_0())
        self.ff = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(approximate="tanh"), nn.Linear(4 * dim, dim))
        self.ff_context = None if context_pre_only else nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, hidden_states, encoder_hidden_states, joint_attention_kwargs=None):
        joint_attention_kwargs = joint_attention_kwargs or {}
        attn_output, context_attn_output = self.attn(
            hidden_states=self.norm1(hidden_states),
            encoder_hidden_states=self.norm1_context(encoder_hidden_states), **joint_attention_kwargs)
        hidden_states = hidden_states + attn_output
        hidden_states = hidden_states + self.ff(hidden_states)
        if self.context_pre_only:
            return None, hidden_states
        encoder_hidden_states = encoder_hidden_states + context_attn_output
        encoder_hidden_states = encoder_hidden_states + self.ff_context(encoder_hidden_states)
        return encoder_hidden_states, hidden_states


def _get_t5_prompt_embeds(text_encoder, token_embedding, prompts, max_sequence_length=12, pad_id=0):
    """Pad to max_sequence_length and encode WITHOUT the tokenizer's attention mask, as SD3's pipeline does."""
    text_input_ids = torch.full((len(prompts), max_sequence_length), pad_id, dtype=torch.long)
    for i, ids in enumerate(prompts):
        text_input_ids[i, :len(ids)] = torch.tensor(ids)
    return text_encoder(token_embedding(text_input_ids))


def joint_reference(attn, x, c):
    """Double-checked joint attention: explicit softmax over all image + text keys, no mask."""
    B, N, D = x.shape
    h, d = attn.heads, D // attn.heads
    split = lambda t: t.view(B, -1, h, d).transpose(1, 2)
    q = torch.cat([split(attn.to_q(x)), split(attn.add_q_proj(c))], 2)
    k = torch.cat([split(attn.to_k(x)), split(attn.add_k_proj(c))], 2)
    v = torch.cat([split(attn.to_v(x)), split(attn.add_v_proj(c))], 2)
    p = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(d), -1)
    o = (p @ v).transpose(1, 2).reshape(B, -1, D)
    return attn.to_out[0](o[:, :N])


def main():
    torch.manual_seed(0)
    dim, heads = 32, 4
    token_embedding = nn.Embedding(40, dim)
    t5_layer = nn.TransformerEncoderLayer(dim, heads, 64, dropout=0.0, batch_first=True)
    text_encoder = nn.TransformerEncoder(t5_layer, 1, enable_nested_tensor=False).eval()
    blocks = nn.ModuleList([JointTransformerBlock(dim, heads), JointTransformerBlock(dim, heads, context_pre_only=True)]).eval()
    prompts = [[5, 9, 13, 2], [7, 3, 21, 30, 11, 2]]
    with torch.no_grad():
        encoder_hidden_states = _get_t5_prompt_embeds(text_encoder, token_embedding, prompts)
        hidden_states = torch.randn(2, 16, dim)  # 4x4 latent patches
        x0, c0 = hidden_states, encoder_hidden_states
        ref = joint_reference(blocks[0].attn, blocks[0].norm1(x0), blocks[0].norm1_context(c0))
        out, _ = blocks[0].attn(blocks[0].norm1(x0), encoder_hidden_states=blocks[0].norm1_context(c0))
        assert torch.allclose(out, ref, atol=1e-5)
        for block in blocks:
            encoder_hidden_states, hidden_states = block(hidden_states, encoder_hidden_states)
        # the padded T5 slots are part of the conditioning: changing one changes the image tokens
        c_alt = c0.clone()
        c_alt[0, -1] += 1.0
        x_alt = x0
        for block in blocks:
            c_alt, x_alt = block(x_alt, c_alt)
        assert not torch.allclose(x_alt[0], hidden_states[0])
    print("sd3 joint attention ok", tuple(hidden_states.shape))


if __name__ == "__main__":
    main()
