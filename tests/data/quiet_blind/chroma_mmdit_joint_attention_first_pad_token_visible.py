"""MMDiT double-stream block (Flux / Chroma layout): joint attention over [text tokens, image tokens].

Follows huggingface/diffusers src/diffusers/pipelines/chroma/pipeline_chroma.py (_get_t5_prompt_embeds:
`attention_mask = mask_indices <= seq_lengths`, i.e. the real tokens AND the first padding token stay visible;
_prepare_attention_mask: that text mask, then ones for the image tokens) and
src/diffusers/models/transformers/transformer_chroma.py (text first in the joint sequence, as in Flux).
Each stream has its own qkv projections; the two streams meet in ONE attention call over the concatenated
sequence. Mask: padded T5 keys hidden except the first pad token, every image key visible, no causal part (a
diffusion model denoises all image tokens at once). Chroma's transformer also hides padded text *query* rows
(outer product of the mask); here the mask is [B, 1, 1, S] (key side only, as a Flux-style processor takes it):
padded text queries compute a row whose output is never used (the text stream is dropped after the last block),
so the image output is the same. A prompt padded to max_sequence_length gives the same image output as the
prompt followed by its one visible pad token alone.
"""
import torch
from torch import nn
import torch.nn.functional as F


class ChromaConfig:
    num_attention_heads = 4
    attention_head_dim = 8
    max_sequence_length = 6
    patch_size = 1

    @property
    def inner_dim(self):
        return self.num_attention_heads * self.attention_head_dim


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(1.0 + 0.1 * torch.randn(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class JointAttention(nn.Module):
    """Attention with an image stream (to_q/to_k/to_v) and a context stream (add_q_proj/...)."""

    def __init__(self, dim, heads, dim_head):
        super().__init__()
        self.heads = heads
        self.to_q, self.to_k, self.to_v = (nn.Linear(dim, heads * dim_head) for _ in range(3))
        self.add_q_proj, self.add_k_proj, self.add_v_proj = (nn.Linear(dim, heads * dim_head) for _ in range(3))
        self.norm_q, self.norm_k = RMSNorm(dim_head), RMSNorm(dim_head)
        self.norm_added_q, self.norm_added_k = RMSNorm(dim_head), RMSNorm(dim_head)
        self.to_out = nn.Linear(heads * dim_head, dim)
        self.to_add_out = nn.Linear(heads * dim_head, dim)

    def forward(self, hidden_states, encoder_hidden_states, attention_mask=None):
        b = hidden_states.shape[0]

        def heads(x):
            return x.unflatten(-1, (self.heads, -1)).transpose(1, 2)

        query = self.norm_q(heads(self.to_q(hidden_states)))
        key = self.norm_k(heads(self.to_k(hidden_states)))
        value = heads(self.to_v(hidden_states))
        encoder_query = self.norm_added_q(heads(self.add_q_proj(encoder_hidden_states)))
        encoder_key = self.norm_added_k(heads(self.add_k_proj(encoder_hidden_states)))
        encoder_value = heads(self.add_v_proj(encoder_hidden_states))

        # text first, then image: the order of txt_ids / img_ids
        query = torch.cat([encoder_query, query], dim=2)
        key = torch.cat([encoder_key, key], dim=2)
        value = torch.cat([encoder_value, value], dim=2)

        out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask)
        out = out.transpose(1, 2).reshape(b, -1, query.shape[1] * query.shape[-1])
        txt_len = encoder_hidden_states.shape[1]
        encoder_out, out = out[:, :txt_len], out[:, txt_len:]
        return self.to_out(out), self.to_add_out(encoder_out)


class ChromaTransformerBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        dim = config.inner_dim
        self.norm1 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.norm1_context = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.attn = JointAttention(dim, config.num_attention_heads, config.attention_head_dim)
        self.ff = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(approximate="tanh"), nn.Linear(4 * dim, dim))
        self.ff_context = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(approximate="tanh"), nn.Linear(4 * dim, dim))

    def forward(self, hidden_states, encoder_hidden_states, temb, attention_mask):
        # Chroma's approximator gives shift/scale/gate per block from the timestep alone.
        shift, scale, gate = temb.chunk(3, dim=-1)
        norm_h = self.norm1(hidden_states) * (1 + scale[:, None]) + shift[:, None]
        norm_c = self.norm1_context(encoder_hidden_states) * (1 + scale[:, None]) + shift[:, None]
        attn_output, context_attn_output = self.attn(norm_h, norm_c, attention_mask=attention_mask)
        hidden_states = hidden_states + gate[:, None] * attn_output
        hidden_states = hidden_states + self.ff(hidden_states)
        encoder_hidden_states = encoder_hidden_states + gate[:, None] * context_attn_output
        encoder_hidden_states = encoder_hidden_states + self.ff_context(encoder_hidden_states)
        return encoder_hidden_states, hidden_states


def _prepare_attention_mask(batch_size, text_attention_mask, image_seq_len):
    """[B, txt] text mask + ones for the image -> [B, 1, 1, txt + img] boolean key mask."""
    image_mask = torch.ones(batch_size, image_seq_len, dtype=torch.bool)
    attention_mask = torch.cat([text_attention_mask.bool(), image_mask], dim=1)
    return attention_mask[:, None, None, :]


def main():
    torch.manual_seed(0)
    config = ChromaConfig()
    blocks = nn.ModuleList([ChromaTransformerBlock(config) for _ in range(2)]).eval()
    dim = config.inner_dim
    image_seq_len = 16  # 4x4 latent, patch_size 1
    prompt_embeds = torch.randn(2, config.max_sequence_length, dim)
    tokenizer_mask = torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 1, 0, 0, 0]])
    # Chroma: all except the first padding token are masked out in the transformer.
    seq_lengths = tokenizer_mask.sum(dim=1)
    mask_indices = torch.arange(tokenizer_mask.size(1)).unsqueeze(0).expand(2, -1)
    text_attention_mask = mask_indices <= seq_lengths.unsqueeze(1)
    latents = torch.randn(2, image_seq_len, dim)
    temb = 0.1 * torch.randn(2, 3 * dim)

    def run(hidden_states, encoder_hidden_states, t, mask):
        with torch.no_grad():
            for block in blocks:
                encoder_hidden_states, hidden_states = block(hidden_states, encoder_hidden_states, t, mask)
        return hidden_states

    mask = _prepare_attention_mask(2, text_attention_mask, image_seq_len)
    batched = run(latents, prompt_embeds, temb, mask)
    alone = run(latents[1:], prompt_embeds[1:, :4], temb[1:], None)
    assert torch.allclose(batched[1], alone[0], atol=1e-5), (batched[1] - alone[0]).abs().max()
    print("mmdit joint attention ok:", tuple(batched.shape))


if __name__ == "__main__":
    main()
