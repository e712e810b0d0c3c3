"""vLLM-Omni CosyVoice3 DiT: the streaming chunk mask is applied to the attention output, not to the scores.

Citation: vllm-project/vllm-omni#5704 ("[Bugfix][CosyVoice3] Fix DiT streaming chunk attention mask",
2026-08-03; an open pull request when I read it). From its description: "CosyVoice3 streaming code2wav
requires chunk attention masks so each frame only attends within its allowed time window. The current
cosyvoice3_dit.py uses DiffusionAttention, which does not pass the mask into softmax - it only zeroes
outputs afterward via masked_fill." The PR switches DiTAttention to
F.scaled_dot_product_attention(..., attn_mask=...) and adds subsequent_chunk_mask /
add_optional_chunk_mask (aligned with CosyVoice3's own code), forwarding `streaming` from the CFM to
the DiT estimator. I read the description only, not the diff.

Bug: in the flow-matching DiT (code2wav), every mel frame attended to every frame of the batch row,
future chunks and right padding included; the mask only zeroed padded outputs after attention.
Fix: build the chunk mask (frames see their own chunk and all earlier chunks, never padding) and
pass it into softmax.

Reproduction: a small DiT estimator written like CosyVoice's (x, mask, mu, t, spks, cond, streaming),
two utterances of 10 and 7 mel frames padded to 10, chunk size 4 frames, streaming=True.
"""
import sys

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv


def subsequent_chunk_mask(size: int, chunk_size: int, num_left_chunks: int = -1, device=None):
    """Frame i may see frames up to the end of its own chunk (CosyVoice / WeNet convention)."""
    pos_idx = torch.arange(size, device=device)
    block_value = (torch.div(pos_idx, chunk_size, rounding_mode="trunc") + 1) * chunk_size
    return pos_idx.unsqueeze(0) < block_value.unsqueeze(1)


def add_optional_chunk_mask(xs, masks, static_chunk_size):
    """masks: (B, 1, T) bool -> (B, T, T) bool."""
    if static_chunk_size > 0:
        chunk_masks = subsequent_chunk_mask(xs.size(1), static_chunk_size, device=xs.device)
        return masks & chunk_masks.unsqueeze(0)
    return masks.expand(-1, xs.size(1), -1)


class DiTAttention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.to_q, self.to_k, self.to_v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.to_out = nn.Linear(dim, dim)

    def forward(self, x, mask, attn_mask):
        b, n, d = x.shape
        q, k, v = (f(x).view(b, n, self.heads, -1).transpose(1, 2) for f in (self.to_q, self.to_k, self.to_v))
        if FIXED:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask.unsqueeze(1))
        else:
            # DiffusionAttention: no mask inside softmax
            out = F.scaled_dot_product_attention(q, k, v)
        out = self.to_out(out.transpose(1, 2).reshape(b, n, d))
        # padded frames are zeroed afterwards
        return out.masked_fill(~mask.unsqueeze(-1), 0.0)


class DiTBlock(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.attn = DiTAttention(dim, heads)
        self.ff = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x, t, mask, attn_mask):
        x = x + self.attn(self.norm(x) + t[:, None], mask, attn_mask)
        return x + self.ff(x)


class DiT(nn.Module):
    def __init__(self, dim=32, depth=2, heads=4, mel_dim=8, static_chunk_size=4):
        super().__init__()
        self.static_chunk_size = static_chunk_size
        self.input_embed = nn.Linear(mel_dim * 3 + mel_dim, dim)
        self.time_embed = nn.Linear(1, dim)
        self.transformer_blocks = nn.ModuleList(DiTBlock(dim, heads) for _ in range(depth))
        self.proj_out = nn.Linear(dim, mel_dim)

    def forward(self, x, mask, mu, t, spks=None, cond=None, streaming=False):
        # x, mu, cond: (B, mel_dim, T); mask: (B, 1, T)
        spks = spks[:, :, None].expand_as(x)
        h = self.input_embed(torch.cat([x, cond, mu, spks], dim=1).transpose(1, 2))
        temb = self.time_embed(t[:, None])
        if streaming:
            attn_mask = add_optional_chunk_mask(h, mask.bool(), self.static_chunk_size)
        else:
            attn_mask = add_optional_chunk_mask(h, mask.bool(), 0)
        key_mask = mask.bool().squeeze(1)
        for block in self.transformer_blocks:
            h = block(h, temb, key_mask, attn_mask)
        return self.proj_out(h).transpose(1, 2) * mask


def main():
    torch.manual_seed(0)
    mel_dim, T = 8, 10
    estimator = DiT(mel_dim=mel_dim, static_chunk_size=4).eval()
    feat_len = torch.tensor([10, 7])
    mask = (torch.arange(T)[None, :] < feat_len[:, None]).unsqueeze(1).float()  # (B, 1, T)
    x = torch.randn(2, mel_dim, T)
    mu = torch.randn(2, mel_dim, T) * mask
    cond = torch.zeros(2, mel_dim, T)
    spks = torch.randn(2, mel_dim)
    t = torch.tensor([0.3, 0.3])
    with torch.no_grad():
        dphi_dt = estimator(x, mask, mu, t, spks, cond, streaming=True)
    print("dphi_dt[0,0,:4]", [round(v, 4) for v in dphi_dt[0, 0, :4].tolist()])


if __name__ == "__main__":
    main()
