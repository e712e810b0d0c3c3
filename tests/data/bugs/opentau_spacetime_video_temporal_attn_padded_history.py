"""OpenTau pi05_mem SpaceTime SigLIP video encoder: temporal attention reads padded history frames.

Citation: TensorAuto/OpenTau#254 ("fix(pi05_mem): mask padded history; preserve current state token; emit at
inference", commit 8fffb25), the port of the same fix in TensorAuto/OpenTau#253 (pi07) and #205.

Bug: ``_TemporalSelfAttention.forward`` runs one temporal sequence per spatial patch (``(B*N, T, D)``) with
``F.scaled_dot_product_attention(..., attn_mask=None, is_causal=True)``. The dataset marks padded history
steps in ``obs_history_is_pad`` (B, T), but ``SpaceTimeSiglipVideoEncoder.forward(video)`` never received it:
zero-pixel history frames still get non-zero hidden states (patch-embedding bias, temporal position
embedding), and the current frame attends them.
Fix: ``forward(video, obs_history_is_pad)`` builds ``_build_temporal_attn_mask``: a ``(B*N, 1, T, T)``
additive mask, causal AND key frame not padded (current frame always kept), ``repeat_interleave(N)`` over
the patch batch, passed to SDPA with ``is_causal=False``.

This program: the space-time wrapper reduced to its temporal attention (patch embedding = a linear layer
with bias, learned temporal position embedding), 3 frames x 4 patches, a batch of two clips where clip 0
has its two history frames padded (``obs_history_is_pad = [[True, True, False], [False, False, False]]``).
"""
import sys

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv


class _TemporalSelfAttention(nn.Module):
    def __init__(self, dim, num_heads):
        super().__init__()
        self.num_heads, self.scale = num_heads, (dim // num_heads) ** -0.5
        self.q_proj, self.k_proj = nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.v_proj, self.out_proj = nn.Linear(dim, dim), nn.Linear(dim, dim)

    def forward(self, hidden_states, temporal_attn_mask=None):
        """hidden_states: (B*N, T, D) -> (B*N, T, D)."""
        bn, t, d = hidden_states.shape
        head_dim = d // self.num_heads
        q = self.q_proj(hidden_states).view(bn, t, self.num_heads, head_dim).transpose(1, 2)
        k = self.k_proj(hidden_states).view(bn, t, self.num_heads, head_dim).transpose(1, 2)
        v = self.v_proj(hidden_states).view(bn, t, self.num_heads, head_dim).transpose(1, 2)
        if temporal_attn_mask is not None:
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=temporal_attn_mask, is_causal=False, dropout_p=0.0, scale=self.scale
            )
        else:
            # is_causal=True -> lower-triangular mask, each position attends to
            # itself and earlier positions (our convention: t=T-1 is current).
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=None, is_causal=True, dropout_p=0.0, scale=self.scale)
        out = out.transpose(1, 2).reshape(bn, t, d)
        return self.out_proj(out)


class SpaceTimeSiglipVideoEncoder(nn.Module):
    def __init__(self, patch_dim=12, dim=16, num_heads=2, num_frames=3, num_video_tokens=4):
        super().__init__()
        self.num_frames, self.num_video_tokens = num_frames, num_video_tokens
        self.patch_embedding = nn.Linear(patch_dim, dim)  # has a bias: zero pixels -> non-zero tokens
        self.temporal_pos_embed = nn.Parameter(torch.randn(num_frames, dim) * 0.5)
        self.layer_norm1 = nn.LayerNorm(dim)
        self._temporal_attn = _TemporalSelfAttention(dim, num_heads)

    @staticmethod
    def _build_temporal_attn_mask(obs_history_is_pad, num_patches, dtype):
        b, t = obs_history_is_pad.shape
        causal = torch.tril(torch.ones(t, t, dtype=torch.bool))
        key_valid = ~obs_history_is_pad
        key_valid[:, -1] = True
        mask_bool = causal.unsqueeze(0) & key_valid.unsqueeze(1)  # (B, T, T)
        float_mask = torch.zeros(b, t, t, dtype=dtype)
        float_mask.masked_fill_(~mask_bool, float("-inf"))
        float_mask = float_mask.unsqueeze(1)  # (B, 1, T, T)
        return float_mask.repeat_interleave(num_patches, dim=0)  # (B*N, 1, T, T)

    def forward(self, video, obs_history_is_pad=None):
        """video: (B, T, N, patch_dim) patchified pixels -> current-frame tokens (B, N, D)."""
        b, t, n, _ = video.shape
        hidden = self.patch_embedding(video) + self.temporal_pos_embed[None, :, None, :]
        temporal_attn_mask = None
        if FIXED and t > 1:
            if obs_history_is_pad is not None:
                temporal_attn_mask = self._build_temporal_attn_mask(obs_history_is_pad, self.num_video_tokens, hidden.dtype)
            else:
                fallback_pad = torch.ones(b, t, dtype=torch.bool)
                fallback_pad[:, -1] = False
                temporal_attn_mask = self._build_temporal_attn_mask(fallback_pad, self.num_video_tokens, hidden.dtype)
        t_in = hidden.permute(0, 2, 1, 3).reshape(b * n, t, -1)  # "b t n d -> (b n) t d"
        t_out = self._temporal_attn(self.layer_norm1(t_in), temporal_attn_mask=temporal_attn_mask)
        hidden = (t_in + t_out).reshape(b, n, t, -1)
        return hidden[:, :, -1]


class PI05Policy(nn.Module):
    def __init__(self):
        super().__init__()
        self.video_encoder = SpaceTimeSiglipVideoEncoder()

    def embed_video(self, batch):
        if FIXED:
            return self.video_encoder(batch["video"], obs_history_is_pad=batch["obs_history_is_pad"])
        return self.video_encoder(batch["video"])


def main():
    torch.manual_seed(0)
    policy = PI05Policy().eval()
    obs_history_is_pad = torch.tensor([[True, True, False], [False, False, False]])
    video = torch.rand(2, 3, 4, 12)
    video[obs_history_is_pad] = 0.0  # padded history slots are zero pixels
    batch = {"video": video, "obs_history_is_pad": obs_history_is_pad}
    with torch.no_grad():
        tokens = policy.embed_video(batch)
    print("video tokens", tuple(tokens.shape), "clip-0 sum %.5f" % tokens[0].abs().sum())


if __name__ == "__main__":
    main()
