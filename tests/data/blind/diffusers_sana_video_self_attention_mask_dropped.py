# huggingface/diffusers#13606 (sana_video review): SanaVideoTransformer3DModel converts `attention_mask`
# (latent-token mask) and passes it to every block, but SanaVideoTransformerBlock never forwards it to attn1.
import sys
import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class Attention(nn.Module):
    def __init__(self, query_dim, heads, dim_head, cross_attention_dim=None):
        super().__init__()
        self.heads = heads
        inner = heads * dim_head
        kv_dim = cross_attention_dim or query_dim
        self.to_q = nn.Linear(query_dim, inner)
        self.to_k = nn.Linear(kv_dim, inner)
        self.to_v = nn.Linear(kv_dim, inner)
        self.to_out = nn.Linear(inner, query_dim)

    def forward(self, hidden_states, encoder_hidden_states=None, attention_mask=None):
        B, N, _ = hidden_states.shape
        ctx = hidden_states if encoder_hidden_states is None else encoder_hidden_states
        q, k, v = self.to_q(hidden_states), self.to_k(ctx), self.to_v(ctx)
        q, k, v = (t.view(B, -1, self.heads, t.shape[-1] // self.heads).transpose(1, 2) for t in (q, k, v))
        if attention_mask is not None:
            # (B, 1, S_k) additive bias -> (B, heads, 1, S_k), broadcast over queries
            attention_mask = attention_mask.view(B, 1, 1, -1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask)
        return self.to_out(out.transpose(1, 2).reshape(B, N, -1))


class SanaVideoTransformerBlock(nn.Module):
    def __init__(self, dim, heads, dim_head, cross_attention_dim):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn1 = Attention(dim, heads, dim_head)
        self.norm2 = nn.LayerNorm(dim)
        self.attn2 = Attention(dim, heads, dim_head, cross_attention_dim)
        self.ff = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, hidden_states, attention_mask=None, encoder_hidden_states=None, encoder_attention_mask=None):
        norm_hidden_states = self.norm1(hidden_states)
        if FIXED:
            attn_output = self.attn1(norm_hidden_states, attention_mask=attention_mask)
        else:
            attn_output = self.attn1(norm_hidden_states)  # attention_mask never forwarded
        hidden_states = hidden_states + attn_output
        hidden_states = hidden_states + self.attn2(
            self.norm2(hidden_states), encoder_hidden_states=encoder_hidden_states, attention_mask=encoder_attention_mask
        )
        return hidden_states + self.ff(hidden_states)


class SanaVideoTransformer3DModel(nn.Module):
    def __init__(self, in_channels=4, dim=32, heads=2, num_layers=2, caption_channels=16, patch_size=(1, 2, 2)):
        super().__init__()
        self.patch_size = patch_size
        p_t, p_h, p_w = patch_size
        self.patch_embed = nn.Conv3d(in_channels, dim, kernel_size=patch_size, stride=patch_size)
        self.caption_projection = nn.Linear(caption_channels, dim)
        self.transformer_blocks = nn.ModuleList(
            [SanaVideoTransformerBlock(dim, heads, dim // heads, dim) for _ in range(num_layers)]
        )
        self.proj_out = nn.Linear(dim, in_channels * p_t * p_h * p_w)

    def forward(self, hidden_states, encoder_hidden_states, attention_mask=None, encoder_attention_mask=None):
        # convert masks to biases the same way the upstream model does: keep=1 -> 0, drop=0 -> -10000
        if attention_mask is not None and attention_mask.ndim == 2:
            attention_mask = (1 - attention_mask.to(hidden_states.dtype)) * -10000.0
            attention_mask = attention_mask.unsqueeze(1)
        if encoder_attention_mask is not None and encoder_attention_mask.ndim == 2:
            encoder_attention_mask = (1 - encoder_attention_mask.to(hidden_states.dtype)) * -10000.0
            encoder_attention_mask = encoder_attention_mask.unsqueeze(1)

        hidden_states = self.patch_embed(hidden_states).flatten(2).transpose(1, 2)  # (B, T*H*W, dim)
        encoder_hidden_states = self.caption_projection(encoder_hidden_states)
        for block in self.transformer_blocks:
            hidden_states = block(hidden_states, attention_mask, encoder_hidden_states, encoder_attention_mask)
        return self.proj_out(hidden_states)


model = SanaVideoTransformer3DModel().eval()
B, C, T, H, W = 2, 4, 2, 8, 8
latents = torch.randn(B, C, T, H, W)
prompt_embeds = torch.randn(B, 6, 16)
prompt_attention_mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0]])
num_tokens = T * (H // 2) * (W // 2)  # 32 latent tokens
# second video: only its first frame is real, the second latent frame is padding
latent_attention_mask = torch.ones(B, num_tokens, dtype=torch.long)
latent_attention_mask[1, num_tokens // 2:] = 0

with torch.no_grad():
    out = model(latents, prompt_embeds, latent_attention_mask, prompt_attention_mask)
    # reference: the real half of video 1 run alone (nothing padded) must match
    ref = model(latents[1:, :, :1], prompt_embeds[1:], None, prompt_attention_mask[1:])
diff = (out[1, : num_tokens // 2] - ref[0]).abs().max().item()
print(f"fixed={FIXED} max |masked-batch output - unpadded reference| on real tokens = {diff:.3e}")
