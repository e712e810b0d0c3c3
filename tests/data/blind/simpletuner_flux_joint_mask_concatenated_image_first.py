"""SimpleTuner Flux (masked attention): joint mask concatenated [image, text] while q/k are [text, image].

Citation: bghira/SimpleTuner#904 ("Bug in Flux with Masked Attention", closed), fixed in
bghira/SimpleTuner#908.  Read: the issue thread only ("the mask attention concatenates
mask = [image_mask, text_mask]. However, the order is reverse for attention computation, e.g.,
q = [q_text, q_image]" — maintainer: "Fixed in #908. I didn't notice that the location of text had
been swapped versus sd3/auraflow").  I could not read helpers/models/flux/transformer.py at the
buggy commit nor the diff of #908; the transformer below follows diffusers' Flux joint attention
(text tokens first in q/k/v) and the masking wrapper the issue describes.

Bug: the T5 `attention_mask` (B, txt_len) was extended with ones for the image tokens as
`cat([image_mask, text_mask])`, but the joint sequence is `[text, image]`; so the text padding
stayed visible and image tokens at positions txt_len.. were masked by text-padding flags.
Fix (#908): `cat([text_mask, image_mask])`, matching the joint token order.

Reproduction: one Flux double-stream block (separate text/image qkv, joint SDPA over
cat([encoder_hidden_states, hidden_states])) with the masking wrapper; batch 2, 6 text tokens
(prompt lengths 3 and 6), 8 image tokens.
"""
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


class FluxAttnProcessorWithMask:
    """Joint attention; `attention_mask` is (B, txt+img) with 1 = attend (key padding)."""

    def __call__(self, attn, hidden_states, encoder_hidden_states, attention_mask=None):
        batch_size = hidden_states.shape[0]
        head_dim = attn.inner_dim // attn.heads

        def heads(x):
            return x.view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)

        query, key, value = heads(attn.to_q(hidden_states)), heads(attn.to_k(hidden_states)), heads(attn.to_v(hidden_states))
        e_query = heads(attn.add_q_proj(encoder_hidden_states))
        e_key = heads(attn.add_k_proj(encoder_hidden_states))
        e_value = heads(attn.add_v_proj(encoder_hidden_states))

        # attention: text first, then image
        query = torch.cat([e_query, query], dim=2)
        key = torch.cat([e_key, key], dim=2)
        value = torch.cat([e_value, value], dim=2)

        if attention_mask is not None:
            attention_mask = attention_mask[:, None, None, :].bool()
        hidden_states = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask)
        hidden_states = hidden_states.transpose(1, 2).reshape(batch_size, -1, attn.inner_dim)
        txt_len = encoder_hidden_states.shape[1]
        encoder_hidden_states, hidden_states = hidden_states[:, :txt_len], hidden_states[:, txt_len:]
        return attn.to_out(hidden_states), attn.to_add_out(encoder_hidden_states)


class Attention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads, self.inner_dim = heads, dim
        self.to_q, self.to_k, self.to_v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.add_q_proj, self.add_k_proj, self.add_v_proj = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.to_out, self.to_add_out = nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.processor = FluxAttnProcessorWithMask()

    def forward(self, hidden_states, encoder_hidden_states, attention_mask=None):
        return self.processor(self, hidden_states, encoder_hidden_states, attention_mask)


class FluxTransformerBlock(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.norm1_context = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)

    def forward(self, hidden_states, encoder_hidden_states, attention_mask=None):
        attn_output, context_attn_output = self.attn(self.norm1(hidden_states), self.norm1_context(encoder_hidden_states),
                                                     attention_mask=attention_mask)
        return encoder_hidden_states + context_attn_output, hidden_states + attn_output


class FluxTransformer2DModelWithMasking(nn.Module):
    def __init__(self, in_channels=4, joint_attention_dim=12, dim=16, heads=2, num_layers=2):
        super().__init__()
        self.x_embedder = nn.Linear(in_channels, dim)
        self.context_embedder = nn.Linear(joint_attention_dim, dim)
        self.transformer_blocks = nn.ModuleList([FluxTransformerBlock(dim, heads) for _ in range(num_layers)])
        self.proj_out = nn.Linear(dim, in_channels)

    def forward(self, hidden_states, encoder_hidden_states, attention_mask=None):
        hidden_states = self.x_embedder(hidden_states)
        encoder_hidden_states = self.context_embedder(encoder_hidden_states)
        if attention_mask is not None:
            # extend the text mask with ones over the image tokens
            image_mask = torch.ones(hidden_states.shape[0], hidden_states.shape[1], dtype=attention_mask.dtype)
            if FIXED:
                attention_mask = torch.cat([attention_mask, image_mask], dim=1)
            else:
                attention_mask = torch.cat([image_mask, attention_mask], dim=1)
        for block in self.transformer_blocks:
            encoder_hidden_states, hidden_states = block(hidden_states, encoder_hidden_states, attention_mask)
        return self.proj_out(hidden_states)


def main():
    torch.manual_seed(0)
    model = FluxTransformer2DModelWithMasking().eval()
    latents = torch.randn(2, 8, 4)  # packed 2x2 latent patches, 8 image tokens
    prompt_embeds = torch.randn(2, 6, 12)  # T5 hidden states, padded to 6
    attention_mask = torch.tensor([[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1]])
    with torch.no_grad():
        noise_pred = model(latents, prompt_embeds, attention_mask=attention_mask)
    print("noise_pred checksum", round(noise_pred.sum().item(), 4))


if __name__ == "__main__":
    main()
