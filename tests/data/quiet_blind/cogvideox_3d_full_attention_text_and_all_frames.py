"""CogVideoX expert transformer block: text tokens and the patches of ALL video frames in one full attention.

Follows THUDM/CogVideo and huggingface/diffusers src/diffusers/models/transformers/cogvideox_transformer_3d.py
(CogVideoXPatchEmbed: text_embeds concatenated before the flattened (frames * h * w) video patches;
CogVideoXBlock with CogVideoXLayerNormZero giving separate modulation for text and video ("expert adaLN"))
and attention_processor.py (CogVideoXAttnProcessor2_0: F.scaled_dot_product_attention with attn_mask=None over
the joint sequence). Recalled, not read line by line.

Mask meant: none. CogVideoX replaced factorized spatial / temporal attention with 3D full attention on
purpose: every frame's patches attend every other frame (past and future) and the text, and text attends the
video. Generation is a diffusion denoising of the whole clip, not frame by frame, so nothing is causal. The
prompt here fills its text length exactly (no padding tokens).
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


class CogVideoXPatchEmbed(nn.Module):
    def __init__(self, patch_size=2, in_channels=4, embed_dim=32, text_embed_dim=24):
        super().__init__()
        self.proj = nn.Conv2d(in_channels, embed_dim, patch_size, patch_size)
        self.text_proj = nn.Linear(text_embed_dim, embed_dim)

    def forward(self, text_embeds, image_embeds):
        text_embeds = self.text_proj(text_embeds)
        b, f, c, h, w = image_embeds.shape
        image_embeds = self.proj(image_embeds.reshape(-1, c, h, w))
        image_embeds = image_embeds.view(b, f, *image_embeds.shape[1:]).flatten(3).transpose(2, 3)  # b f hw d
        image_embeds = image_embeds.flatten(1, 2)                                                   # b (f h w) d
        return torch.cat([text_embeds, image_embeds], dim=1)


class CogVideoXBlock(nn.Module):
    def __init__(self, dim=32, heads=4, time_embed_dim=16):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim, elementwise_affine=False)
        self.norm1_linear = nn.Linear(time_embed_dim, 6 * dim)   # shift, scale, gate for video and for text
        self.to_q, self.to_k, self.to_v = (nn.Linear(dim, dim) for _ in range(3))
        self.norm_q, self.norm_k = nn.LayerNorm(dim // heads), nn.LayerNorm(dim // heads)
        self.to_out = nn.Linear(dim, dim)

    def attn(self, x):
        b, n, d = x.shape
        q, k, v = (p(x).view(b, n, self.heads, -1).transpose(1, 2) for p in (self.to_q, self.to_k, self.to_v))
        q, k = self.norm_q(q), self.norm_k(k)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False)
        return self.to_out(out.transpose(1, 2).reshape(b, n, d)), q, k, v

    def forward(self, hidden_states, encoder_hidden_states, temb):
        text_len = encoder_hidden_states.shape[1]
        shift, scale, gate, enc_shift, enc_scale, enc_gate = self.norm1_linear(F.silu(temb)).chunk(6, dim=1)
        norm_h = self.norm1(hidden_states) * (1 + scale[:, None]) + shift[:, None]
        norm_e = self.norm1(encoder_hidden_states) * (1 + enc_scale[:, None]) + enc_shift[:, None]
        out, q, k, v = self.attn(torch.cat([norm_e, norm_h], dim=1))
        hidden_states = hidden_states + gate[:, None] * out[:, text_len:]
        encoder_hidden_states = encoder_hidden_states + enc_gate[:, None] * out[:, :text_len]
        return hidden_states, encoder_hidden_states, (q, k, v)


num_frames, text_len = 3, 5
latents = torch.randn(1, num_frames, 4, 8, 8)      # (b, f, c, h, w) VAE latents of a clip
prompt_embeds = torch.randn(1, text_len, 24)       # T5 output, prompt exactly text_len long
timestep_emb = torch.randn(1, 16)
patch_embed, block = CogVideoXPatchEmbed(), CogVideoXBlock()
with torch.no_grad():
    hidden = patch_embed(prompt_embeds, latents)
    enc, vid = hidden[:, :text_len], hidden[:, text_len:]
    vid_out, enc_out, (q, k, v) = block(vid, enc, timestep_emb)
    # reference: one softmax over all (text + every frame) keys per query, by explicit loop over queries
    n = q.shape[2]
    ref = torch.stack([(q[:, :, i:i + 1] @ k.transpose(-1, -2) / 8 ** 0.5).softmax(-1) @ v for i in range(n)], 2)
    ref = block.to_out(ref.squeeze(3).transpose(1, 2).reshape(1, n, 32))
    shift, scale, gate, *_ = block.norm1_linear(F.silu(timestep_emb)).chunk(6, dim=1)
    assert torch.allclose(vid_out, vid + gate[:, None] * ref[:, text_len:], atol=1e-5)
    # the first frame's patches are influenced by the last frame (joint, non-causal over time)
    vid2 = vid.clone()
    vid2[:, -16:] += torch.randn(1, 16, 32)
    vid_out2, _, _ = block(vid2, enc, timestep_emb)
    assert not torch.allclose(vid_out2[:, :16], vid_out[:, :16])
print(f"joint sequence: {text_len} text + {num_frames}x16 patches = {n} tokens ok")
