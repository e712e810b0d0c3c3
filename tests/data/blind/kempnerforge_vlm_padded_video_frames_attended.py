"""KempnerForge VLM: blank frames padded into short video clips stayed visible to attention.

Citation: KempnerInstitute/KempnerForge#131 ("Mask padded video frames from attention in the VLM
video path"), fixed by PR #132 (merge 32accd1622fa1218d8248e0f8c0a952f7dcf5eb3).  Source read:
the diff of kempnerforge/model/{attention,vlm}.py and scripts/train.py between 3ad9d9a and
32accd1.

Bug: short clips are padded to `max_frames` with zero frames and the data pipeline emits
`frame_mask` (B, F), True = real frame, but nothing consumed it: the training step called the
VLM without it, `JointDecoderStrategy.prepare` returned a `ModalityContext` with only
`prefix_embeds`, and `Attention.forward` took the plain `is_causal=True` SDPA path — so every
text token (and later visual tokens) attended to the blank frames' visual tokens.
Fix (PR #132): `scripts/train.py` passes `batch["frame_mask"]`; `_prefix_key_padding_mask`
expands it per visual token (`repeat_interleave(tokens_per_frame)`) plus all-True text;
`Attention.forward` ANDs `key_padding_mask.view(B, 1, 1, S)` with the causal mask (and unmasks
fully-masked rows as a NaN guard).

Reproduction: Joint-Decoder VLM (visual tokens prepended to text), a stand-in vision
encoder+adapter giving 2 tokens per frame, 3 frames per clip, batch of 2 clips where the second
has 1 real frame; 2 decoder layers of the project's Attention (SDPA).
"""
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv


@dataclass
class ModalityContext:
    prefix_embeds: torch.Tensor | None = None
    output_slice: slice | None = None
    key_padding_mask: torch.Tensor | None = None


def _visual_token_mask(frame_mask, num_visual_tokens):
    """Expand a per-frame validity mask (B, F) to per-visual-token (B, num_visual_tokens)."""
    if frame_mask is None:
        return None
    num_frames = frame_mask.shape[1]
    if num_visual_tokens % num_frames != 0:
        raise ValueError("visual tokens are not frame-contiguous")
    tokens_per_frame = num_visual_tokens // num_frames
    return frame_mask.repeat_interleave(tokens_per_frame, dim=1)


def _prefix_key_padding_mask(frame_mask, num_visual_tokens, input_ids):
    """Key-validity mask (B, S) for the image-prefix arches: expanded frame mask + all-valid text."""
    vmask = _visual_token_mask(frame_mask, num_visual_tokens)
    if vmask is None:
        return None
    b, t_text = input_ids.shape
    text_valid = torch.ones(b, t_text, dtype=torch.bool, device=vmask.device)
    return torch.cat([vmask, text_valid], dim=1)


class Attention(nn.Module):
    def __init__(self, dim, n_heads):
        super().__init__()
        self.n_heads, self.head_dim = n_heads, dim // n_heads
        self.wqkv = nn.Linear(dim, 3 * dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x, *, doc_ids=None, key_padding_mask=None):
        batch, seq_len, _ = x.shape
        q, k, v = self.wqkv(x).unflatten(-1, (3, self.n_heads, self.head_dim)).permute(2, 0, 3, 1, 4)
        if doc_ids is not None or key_padding_mask is not None:
            seq_len_kv = k.shape[2]
            causal = torch.ones(seq_len, seq_len_kv, dtype=torch.bool, device=q.device).tril()
            attn_mask = causal.unsqueeze(0).unsqueeze(0)  # (1, 1, S, S_kv)
            if doc_ids is not None:
                attn_mask = attn_mask & (doc_ids.unsqueeze(2) == doc_ids.unsqueeze(1)).unsqueeze(1)
            if key_padding_mask is not None:
                attn_mask = attn_mask & key_padding_mask.view(batch, 1, 1, seq_len_kv)
            # NaN guard: a query row with no reachable valid key is unmasked (its output is discarded)
            attn_mask = attn_mask | ~attn_mask.any(dim=-1, keepdim=True)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
        else:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).flatten(-2))


class TransformerBlock(nn.Module):
    def __init__(self, dim, n_heads):
        super().__init__()
        self.attention_norm = nn.RMSNorm(dim)
        self.attention = Attention(dim, n_heads)
        self.mlp_norm = nn.RMSNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.SiLU(), nn.Linear(4 * dim, dim))

    def forward(self, x, key_padding_mask=None):
        x = x + self.attention(self.attention_norm(x), key_padding_mask=key_padding_mask)
        return x + self.mlp(self.mlp_norm(x))


class JointDecoderStrategy:
    """Joint-Decoder: image embeds prepended to the text sequence."""

    def prepare(self, wrapper, pixel_values, input_ids, frame_mask=None):
        img_embeds = wrapper.project_visual_features(pixel_values)
        n = img_embeds.shape[1]
        if FIXED:
            return ModalityContext(prefix_embeds=img_embeds, output_slice=slice(n, None),
                                   key_padding_mask=_prefix_key_padding_mask(frame_mask, n, input_ids))
        return ModalityContext(prefix_embeds=img_embeds, output_slice=slice(n, None))


class VLMWrapper(nn.Module):
    def __init__(self, dim=32, n_heads=4, n_layers=2, vocab_size=64, patch_dim=12, frames_per_clip=3):
        super().__init__()
        self.frames_per_clip = frames_per_clip
        self.vision_encoder = nn.Linear(patch_dim, dim)  # stand-in: 2 patches per frame
        self.adapter = nn.Sequential(nn.Linear(dim, dim), nn.GELU(), nn.Linear(dim, dim))
        self.tok_embeddings = nn.Embedding(vocab_size, dim)
        self.layers = nn.ModuleList([TransformerBlock(dim, n_heads) for _ in range(n_layers)])
        self.norm = nn.RMSNorm(dim)
        self.output = nn.Linear(dim, vocab_size, bias=False)
        self.strategy = JointDecoderStrategy()

    def project_visual_features(self, pixel_values):
        # (B, F, P, patch_dim) -> frame-contiguous visual tokens (B, F * P, dim)
        return self.adapter(self.vision_encoder(pixel_values)).flatten(1, 2)

    def forward(self, pixel_values, input_ids, frame_mask=None):
        ctx = self.strategy.prepare(self, pixel_values, input_ids, frame_mask=frame_mask)
        h = torch.cat([ctx.prefix_embeds, self.tok_embeddings(input_ids)], dim=1)
        for layer in self.layers:
            h = layer(h, key_padding_mask=ctx.key_padding_mask)
        return self.output(self.norm(h))[:, ctx.output_slice]


def train_step(model, batch):
    if FIXED:
        return model(batch["pixel_values"], batch["input_ids"], frame_mask=batch["frame_mask"])
    return model(batch["pixel_values"], batch["input_ids"])


if __name__ == "__main__":
    torch.manual_seed(0)
    model = VLMWrapper().eval()
    pixel_values = torch.randn(2, 3, 2, 12)
    frame_mask = torch.tensor([[True, True, True], [True, False, False]])
    pixel_values[~frame_mask] = 0.0  # short clip padded to max_frames with blank frames
    batch = {"pixel_values": pixel_values, "input_ids": torch.tensor([[5, 9, 13, 2], [7, 11, 3, 2]]),
             "frame_mask": frame_mask}
    with torch.no_grad():
        logits = train_step(model, batch)
    print(f"text logits of the short clip, sum {logits[1].sum().item():.4f}")
