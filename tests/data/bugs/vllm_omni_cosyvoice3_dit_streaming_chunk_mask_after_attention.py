"""vLLM-Omni CosyVoice3 DiT: the streaming chunk mask is applied to the outputs, not to the scores.

Citation: vllm-project/vllm-omni PR #5704 "[Bugfix][CosyVoice3] Fix DiT streaming chunk attention
mask" (open when read; `--fixed` applies its proposed change).

Bug (from the PR description): in streaming code2wav each mel frame of the CosyVoice3 flow-matching
DiT may only attend within its allowed time window (`subsequent_chunk_mask` with
`static_chunk_size`, combined with the padding mask by `add_optional_chunk_mask`). vLLM-Omni's
`cosyvoice3_dit.py` ran the blocks' attention through `DiffusionAttention`, which does not pass the
mask into softmax; the mask was only used afterwards to zero the outputs with `masked_fill`. Every
frame therefore attended to later chunks (and to padding frames of shorter utterances).

Fix: `DiTAttention` calls `F.scaled_dot_product_attention(..., attn_mask=attn_mask)` so the mask is
applied before softmax; `subsequent_chunk_mask` / `add_optional_chunk_mask` are added as in
upstream CosyVoice, and `streaming` is forwarded from the CFM to the DiT estimator.

This program: a two-utterance batch (the second one right-padded), `streaming=True`,
`static_chunk_size=4`, one DiT block. The pre-fix `DiffusionAttention` is rendered as an unmasked
SDPA call followed by the output `masked_fill`. The DiT / mask helper code is written after upstream
CosyVoice (`cosyvoice/flow/DiT/dit.py`, `cosyvoice/utils/mask.py`) as known; the vLLM-Omni module
bodies were not read, only the PR description.
"""
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


def subsequent_chunk_mask(size, chunk_size, num_left_chunks=-1, device=torch.device("cpu")):
    """(size, size) bool mask: frame i sees frames up to the end of its chunk."""
    pos_idx = torch.arange(size, device=device)
    block_value = (torch.div(pos_idx, chunk_size, rounding_mode="trunc") + 1) * chunk_size
    ret = pos_idx.unsqueeze(0) < block_value.unsqueeze(1)
    return ret


def add_optional_chunk_mask(xs, masks, use_dynamic_chunk, use_dynamic_left_chunk,
                            decoding_chunk_size, static_chunk_size, num_decoding_left_chunks):
    # xs: (B, L, D); masks: (B, 1, L) bool padding mask
    if static_chunk_size > 0:
        num_left_chunks = num_decoding_left_chunks
        chunk_masks = subsequent_chunk_mask(xs.size(1), static_chunk_size, num_left_chunks, xs.device)
        chunk_masks = chunk_masks.unsqueeze(0)  # (1, L, L)
        chunk_masks = masks & chunk_masks  # (B, L, L)
    else:
        chunk_masks = masks
    return chunk_masks


class DiffusionAttention(nn.Module):
    """Pre-fix attention layer: no mask argument reaches softmax."""

    def forward(self, query, key, value):
        return F.scaled_dot_product_attention(query, key, value)


class DiTAttention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.to_q = nn.Linear(dim, dim)
        self.to_k = nn.Linear(dim, dim)
        self.to_v = nn.Linear(dim, dim)
        self.to_out = nn.Linear(dim, dim)
        self.attn = DiffusionAttention()

    def forward(self, x, mask=None):
        b, n, d = x.shape
        h = self.heads
        q, k, v = (t.view(b, n, h, d // h).transpose(1, 2) for t in (self.to_q(x), self.to_k(x), self.to_v(x)))
        if FIXED:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        else:
            out = self.attn(q, k, v)
        out = out.transpose(1, 2).reshape(b, n, d)
        out = self.to_out(out)
        if mask is not None:
            # zero the outputs of padding frames (the pre-fix code's only use of the mask)
            frame_valid = mask[:, 0].diagonal(dim1=-2, dim2=-1)  # (B, L)
            out = out.masked_fill(~frame_valid.unsqueeze(-1), 0.0)
        return out


class DiTBlock(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.attn_norm = nn.LayerNorm(dim)
        self.attn = DiTAttention(dim, heads)

    def forward(self, x, t, mask=None):
        return x + self.attn(self.attn_norm(x) + t[:, None], mask=mask)


class DiT(nn.Module):
    def __init__(self, dim=32, heads=4, depth=1, static_chunk_size=4):
        super().__init__()
        self.time_mlp = nn.Linear(1, dim)
        self.transformer_blocks = nn.ModuleList([DiTBlock(dim, heads) for _ in range(depth)])
        self.static_chunk_size = static_chunk_size

    def forward(self, x, mask, t, streaming=False):
        # x: (B, L, D); mask: (B, 1, L) float padding mask from the CFM
        t = self.time_mlp(t[:, None])
        if streaming is True:
            attn_mask = add_optional_chunk_mask(x, mask.bool(), False, False, 0, self.static_chunk_size, -1).unsqueeze(dim=1)
        else:
            attn_mask = add_optional_chunk_mask(x, mask.bool(), False, False, 0, 0, -1).repeat(1, x.size(1), 1).unsqueeze(dim=1)
        for block in self.transformer_blocks:
            x = block(x, t, mask=attn_mask.bool())
        return x


def main():
    torch.manual_seed(0)
    lengths = torch.tensor([12, 9])
    L = 12
    mask = (torch.arange(L)[None, :] < lengths[:, None]).float().unsqueeze(1)  # (B, 1, L)
    x = torch.randn(2, L, 32)
    t = torch.rand(2)
    estimator = DiT().eval()
    with torch.no_grad():
        out = estimator(x, mask, t, streaming=True)
    print("fixed" if FIXED else "buggy", "mel out sum", round(out.sum().item(), 4))


if __name__ == "__main__":
    main()
