"""Pixtral: several images of different sizes share one vision sequence (block-diagonal, non-causal), then a packed
causal LLM over prompts whose [IMG] tokens are replaced by those patch features.

Follows mistralai/mistral-inference src/mistral_inference/vision_encoder.py (``VisionTransformer.forward``:
``patch_embeds_list``, ``position_meshgrid``, ``precompute_freqs_cis_2d``, ``BlockDiagonalMask.from_seqlens``) and
huggingface/transformers src/transformers/models/pixtral/modeling_pixtral.py ``generate_block_attention_mask``
(the same block mask as an additive float tensor), plus the [IMG] / [IMG_BREAK] / [IMG_END] token layout of the
Pixtral processor and mistral-inference's packed decoding (``BlockDiagonalCausalMask.from_seqlens``).

Masks meant: (1) vision encoder: patches attend to every patch of THEIR OWN image in both directions (an image has
no order) and to nothing of the other images packed beside them; images are not padded, each keeps its own
height x width. (2) LLM: causal within each packed prompt, nothing across prompts; image tokens are ordinary causal
positions there (Pixtral does not make them bidirectional in the LLM).
"""
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class VisionEncoderArgs:
    hidden_size: int = 32
    num_channels: int = 3
    image_size: int = 64
    patch_size: int = 4
    intermediate_size: int = 64
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    rope_theta: float = 10000.0
    image_token_id: int = 10
    image_break_token_id: int = 12
    image_end_token_id: int = 13


def precompute_freqs_cis_2d(dim, height, width, theta):
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2).float() / dim))
    h = torch.arange(height)
    w = torch.arange(width)
    freqs_h = torch.outer(h, freqs[::2]).float()
    freqs_w = torch.outer(w, freqs[1::2]).float()
    freqs_2d = torch.cat([freqs_h[:, None, :].repeat(1, width, 1), freqs_w[None, :, :].repeat(height, 1, 1)], dim=-1)
    return torch.polar(torch.ones_like(freqs_2d), freqs_2d)


def apply_rotary_emb(xq, xk, freqs_cis):
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    freqs_cis = freqs_cis[:, None, :]
    return torch.view_as_real(xq_ * freqs_cis).flatten(-2), torch.view_as_real(xk_ * freqs_cis).flatten(-2)


def position_meshgrid(patch_embeds_list):
    return torch.cat([
        torch.stack(torch.meshgrid(torch.arange(p.shape[-2]), torch.arange(p.shape[-1]), indexing="ij"), dim=-1)
        .reshape(-1, 2) for p in patch_embeds_list])


def generate_block_attention_mask(patch_embeds_list, tensor):
    """Additive mask, 0 inside each image's block, finfo.min elsewhere (HF pixtral)."""
    dtype = tensor.dtype
    seq_len = tensor.shape[1]
    d_min = torch.finfo(dtype).min
    causal_mask = torch.full((seq_len, seq_len), fill_value=d_min, dtype=dtype)
    block_end_idx = torch.tensor(patch_embeds_list).cumsum(-1)
    block_start_idx = torch.tensor([0] + patch_embeds_list[:-1]).cumsum(-1)
    for start, end in zip(block_start_idx, block_end_idx):
        causal_mask[start:end, start:end] = 0
    return causal_mask[None, None, :, :].expand(tensor.shape[0], 1, -1, -1)


class VisionAttention(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.n_heads = args.num_attention_heads
        self.head_dim = args.hidden_size // args.num_attention_heads
        self.wq = nn.Linear(args.hidden_size, args.hidden_size, bias=False)
        self.wk = nn.Linear(args.hidden_size, args.hidden_size, bias=False)
        self.wv = nn.Linear(args.hidden_size, args.hidden_size, bias=False)
        self.wo = nn.Linear(args.hidden_size, args.hidden_size, bias=False)

    def forward(self, x, mask, freqs_cis):
        batch, patches, _ = x.shape
        q = self.wq(x).reshape(batch, patches, self.n_heads, self.head_dim)
        k = self.wk(x).reshape(batch, patches, self.n_heads, self.head_dim)
        v = self.wv(x).reshape(batch, patches, self.n_heads, self.head_dim)
        q, k = apply_rotary_emb(q, k, freqs_cis=freqs_cis)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask)
        return self.wo(out.transpose(1, 2).reshape(batch, patches, -1))


class VisionBlock(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.attention_norm = nn.RMSNorm(args.hidden_size, eps=1e-5)
        self.attention = VisionAttention(args)
        self.ffn_norm = nn.RMSNorm(args.hidden_size, eps=1e-5)
        self.w1 = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.w2 = nn.Linear(args.intermediate_size, args.hidden_size, bias=False)
        self.w3 = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)

    def forward(self, x, mask, freqs_cis):
        x = x + self.attention(self.attention_norm(x), mask, freqs_cis)
        h = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class VisionTransformer(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.args = args
        self.patch_conv = nn.Conv2d(args.num_channels, args.hidden_size, args.patch_size, args.patch_size, bias=False)
        self.ln_pre = nn.RMSNorm(args.hidden_size, eps=1e-5)
        self.layers = nn.ModuleList(VisionBlock(args) for _ in range(args.num_hidden_layers))
        max_patches = args.image_size // args.patch_size
        self.freqs_cis = precompute_freqs_cis_2d(args.hidden_size // args.num_attention_heads, max_patches,
                                                 max_patches, args.rope_theta)

    def forward(self, images):
        patch_embeds_list = [self.patch_conv(img.unsqueeze(0)).squeeze(0) for img in images]
        patch_embeds = torch.cat([p.flatten(1).permute(1, 0) for p in patch_embeds_list], dim=0)
        patch_embeds = self.ln_pre(patch_embeds)[None]
        positions = position_meshgrid(patch_embeds_list)
        freqs_cis = self.freqs_cis[positions[:, 0], positions[:, 1]]
        mask = generate_block_attention_mask([p.shape[-2] * p.shape[-1] for p in patch_embeds_list], patch_embeds)
        x = patch_embeds
        for layer in self.layers:
            x = layer(x, mask, freqs_cis)
        return x.squeeze(0), patch_embeds_list


class PackedCausalLM(nn.Module):
    """A one-layer Mistral-style decoder over packed prompts (seqlens), enough to carry the packed causal mask."""

    def __init__(self, vocab, dim, n_heads):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.n_heads = n_heads
        self.wqkv = nn.Linear(dim, 3 * dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        self.output = nn.Linear(dim, vocab, bias=False)

    def attend(self, h, attn_mask=None, is_causal=False):
        q, k, v = self.wqkv(h).chunk(3, dim=-1)
        split = lambda t: t.view(1, t.shape[0], self.n_heads, -1).transpose(1, 2)
        out = F.scaled_dot_product_attention(split(q), split(k), split(v), attn_mask=attn_mask, is_causal=is_causal)
        return self.output(h + self.wo(out.transpose(1, 2).reshape(h.shape[0], -1)))


def block_diagonal_causal_mask(seqlens):
    doc = torch.repeat_interleave(torch.arange(len(seqlens)), torch.tensor(seqlens))
    pos = torch.arange(doc.numel())
    return (doc[:, None] == doc[None, :]) & (pos[:, None] >= pos[None, :])


def image_tokens(args, h, w):
    rows = []
    for r in range(h):
        rows += [args.image_token_id] * w + [args.image_break_token_id if r < h - 1 else args.image_end_token_id]
    return rows


def main():
    torch.manual_seed(0)
    args = VisionEncoderArgs()
    vision = VisionTransformer(args).eval()
    adapter = nn.Linear(args.hidden_size, 32)
    lm = PackedCausalLM(vocab=40, dim=32, n_heads=4).eval()

    # three images of different sizes: 3x4, 2x2 and 4x2 patches (patch_size 4)
    images = [torch.randn(3, 12, 16), torch.randn(3, 8, 8), torch.randn(3, 16, 8)]
    with torch.no_grad():
        feats, patch_embeds_list = vision(images)
        # Reference: each image encoded on its own, with no mask at all.
        start = 0
        for img in images:
            alone, _ = vision([img])
            assert torch.allclose(feats[start:start + alone.shape[0]], alone, atol=1e-5)
            start += alone.shape[0]

        # prompt 0: "<s> [image0] [image1] text", prompt 1: "<s> [image2] text"; packed into one sequence
        grids = [tuple(p.shape[-2:]) for p in patch_embeds_list]
        prompt0 = [1] + image_tokens(args, *grids[0]) + image_tokens(args, *grids[1]) + [20, 21, 22]
        prompt1 = [1] + image_tokens(args, *grids[2]) + [23, 24]
        seqlens = [len(prompt0), len(prompt1)]
        input_ids = torch.tensor(prompt0 + prompt1)
        h = lm.tok_embeddings(input_ids)
        h[input_ids == args.image_token_id] = adapter(feats)  # features in image order, as in the prompts
        logits = lm.attend(h, attn_mask=block_diagonal_causal_mask(seqlens))
        # Reference: each prompt alone with plain causal attention.
        offset = 0
        for n in seqlens:
            alone = lm.attend(h[offset:offset + n], is_causal=True)
            assert torch.allclose(logits[offset:offset + n], alone, atol=1e-5)
            offset += n
    print("vision patches", feats.shape[0], "packed prompt lengths", seqlens)


if __name__ == "__main__":
    main()
