# hao-ai-lab/FastVideo commit 4c5d94cb (PR #1307): LongCatCausalModel did not override
# _build_distill_input_kwargs, so the DFSFT training forward never passed causal_block_size and the
# LongCat DiT ran full bidirectional attention over all video frames instead of its block-causal mask.
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


def build_longcat_block_causal_mask(*, query_frames, key_frames, tokens_per_frame, causal_block_size, device):
    """True = visible. Frames in one causal block see each other, never later blocks."""
    cached_frames = key_frames - query_frames
    q_token_idx = torch.arange(query_frames * tokens_per_frame, device=device)
    k_token_idx = torch.arange(key_frames * tokens_per_frame, device=device)
    q_frame_idx = cached_frames + q_token_idx // tokens_per_frame
    k_frame_idx = k_token_idx // tokens_per_frame
    q_block_end = ((q_frame_idx // causal_block_size + 1) * causal_block_size).clamp(max=key_frames)
    mask = k_frame_idx.unsqueeze(0) < q_block_end.unsqueeze(1)
    return mask.unsqueeze(0).unsqueeze(0)


class LongCatSelfAttention(nn.Module):
    def __init__(self, dim, num_heads):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.to_q, self.to_k, self.to_v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.to_out = nn.Linear(dim, dim)

    def forward(self, x, latent_shape, causal_block_size=None):
        B, N, C = x.shape
        T, H, W = latent_shape
        q = self.to_q(x).view(B, N, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.to_k(x).view(B, N, self.num_heads, self.head_dim).transpose(1, 2)
        v = self.to_v(x).view(B, N, self.num_heads, self.head_dim).transpose(1, 2)
        if causal_block_size is not None:
            attn_mask = build_longcat_block_causal_mask(
                query_frames=T, key_frames=T, tokens_per_frame=H * W,
                causal_block_size=int(causal_block_size), device=x.device)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=0.0, is_causal=False)
        else:
            # dense (bidirectional) video attention, the path of the bidirectional LongCat model
            out = F.scaled_dot_product_attention(q, k, v, dropout_p=0.0, is_causal=False)
        return self.to_out(out.transpose(1, 2).reshape(B, N, C))


class LongCatCrossAttention(nn.Module):
    def __init__(self, dim, num_heads):
        super().__init__()
        self.attn = nn.MultiheadAttention(dim, num_heads, batch_first=True)

    def forward(self, x, y, encoder_attention_mask):
        out, _ = self.attn(x, y, y, key_padding_mask=~encoder_attention_mask.bool(), need_weights=False)
        return out


class LongCatBlock(nn.Module):
    def __init__(self, dim, num_heads):
        super().__init__()
        self.norm1, self.norm2, self.norm3 = nn.LayerNorm(dim), nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = LongCatSelfAttention(dim, num_heads)
        self.cross_attn = LongCatCrossAttention(dim, num_heads)
        self.ffn = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
        self.ada = nn.Linear(dim, 2 * dim)

    def forward(self, x, y, encoder_attention_mask, t_emb, latent_shape, causal_block_size=None):
        shift, scale = self.ada(t_emb).chunk(2, dim=-1)
        x = x + self.attn(self.norm1(x) * (1 + scale) + shift, latent_shape, causal_block_size=causal_block_size)
        x = x + self.cross_attn(self.norm2(x), y, encoder_attention_mask)
        return x + self.ffn(self.norm3(x))


class LongCatTransformer3DModel(nn.Module):
    def __init__(self, in_channels=4, dim=32, num_heads=2, num_layers=2, text_dim=16):
        super().__init__()
        self.patch = nn.Linear(in_channels, dim)
        self.y_proj = nn.Linear(text_dim, dim)
        self.t_proj = nn.Sequential(nn.Linear(1, dim), nn.SiLU(), nn.Linear(dim, dim))
        self.blocks = nn.ModuleList([LongCatBlock(dim, num_heads) for _ in range(num_layers)])
        self.proj_out = nn.Linear(dim, in_channels)

    def forward(self, hidden_states, encoder_hidden_states, encoder_attention_mask, timestep,
                causal_block_size=None):
        B, T, C, H, W = hidden_states.shape  # [B, T, C, H, W]
        x = self.patch(hidden_states.permute(0, 1, 3, 4, 2).reshape(B, T * H * W, C))
        t_emb = self.t_proj(timestep.float().view(B, 1, 1) / 1000.0)
        y = self.y_proj(encoder_hidden_states)
        for block in self.blocks:
            x = block(x, y, encoder_attention_mask, t_emb, (T, H, W), causal_block_size=causal_block_size)
        return self.proj_out(x).view(B, T, H, W, C).permute(0, 4, 1, 2, 3)  # [B, C, T, H, W]


class LongCatModel:
    """Training wrapper of the bidirectional LongCat DiT."""

    def __init__(self, transformer):
        self.transformer = transformer

    def _build_distill_input_kwargs(self, noise_input, timestep, text_dict):
        return {
            "hidden_states": noise_input.permute(0, 2, 1, 3, 4),
            "encoder_hidden_states": text_dict["encoder_hidden_states"],
            "encoder_attention_mask": text_dict["encoder_attention_mask"],
            "timestep": timestep,
        }

    def predict_noise(self, noisy_latents, timestep, text_dict):
        kwargs = self._build_distill_input_kwargs(noisy_latents, timestep, text_dict)
        return -self.transformer(**kwargs)


class LongCatCausalModel(LongCatModel):
    def __init__(self, transformer, causal_block_size=3):
        super().__init__(transformer)
        self._causal_block_size = int(causal_block_size)
        if FIXED:
            self.transformer.num_frame_per_block = self._causal_block_size

    if FIXED:
        def _build_distill_input_kwargs(self, noise_input, timestep, text_dict):
            kwargs = super()._build_distill_input_kwargs(noise_input, timestep, text_dict)
            kwargs["causal_block_size"] = self._causal_block_size
            return kwargs


def dfsft_step(model, opt, latents, text_dict, chunk_size=3):
    """DiffusionForcingSFTMethod: an independent noise level per chunk of frames."""
    B, C, T, H, W = latents.shape
    sigmas = torch.rand(B, T // chunk_size).repeat_interleave(chunk_size, dim=1).view(B, 1, T, 1, 1)
    noise = torch.randn_like(latents)
    noisy = (1 - sigmas) * latents + sigmas * noise
    timestep = (sigmas.mean(dim=(1, 2, 3, 4)) * 1000)
    pred = model.predict_noise(noisy, timestep, text_dict)
    loss = F.mse_loss(pred, noise - latents)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.item()


transformer = LongCatTransformer3DModel()
model = LongCatCausalModel(transformer, causal_block_size=3)
opt = torch.optim.AdamW(transformer.parameters(), lr=1e-3)

latents = torch.randn(2, 4, 6, 2, 2)  # [B, C, T=6 latent frames, H, W]
text_dict = {
    "encoder_hidden_states": torch.randn(2, 5, 16),
    "encoder_attention_mask": torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]),
}
for step in range(3):
    loss = dfsft_step(model, opt, latents, text_dict)
    print(f"dfsft step {step} loss {loss:.4f}")

# Does the first causal block's prediction depend on the frames of the second block?
with torch.no_grad():
    ts = torch.full((2,), 500.0)
    a = model.predict_noise(latents, ts, text_dict)
    changed = latents.clone()
    changed[:, :, 3:] = torch.randn_like(changed[:, :, 3:])
    b = model.predict_noise(changed, ts, text_dict)
print("first-block prediction change from future frames:", (a[:, :, :3] - b[:, :, :3]).abs().max().item())
