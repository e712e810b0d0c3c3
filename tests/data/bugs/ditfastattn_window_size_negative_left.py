"""DiTFastAttn: residual window attention passes window_size=[-w, w] to flash-attn.

Citation: thu-nics/DiTFastAttn#7 ("window attention parameter setting", closed; maintainer
hahnyuan: "You are right. This is a bug ... We have fixed this bug.").

Bug: run_pixart.py built the processor's window as ``window_size=[-args.window_size,
args.window_size]``. flash-attn's ``window_size=(left, right)`` lets query i see keys in
[i - left, i + right], and a negative side means "unbounded" (flash_api.cpp sets a
window_size_left < 0 to seqlen_k). So the "window" attention was left-unbounded: every image
token attended to all earlier tokens plus w later ones, instead of the +-w band the method's
residual-window caching (full - window residual reused on later steps) is defined on.

Fix: ``window_size=[args.window_size, args.window_size]``.

This program: flash_attn is CUDA-only, so ``flash_attn_func`` below is a torch port of its
documented window semantics (negative side = unbounded) over F.scaled_dot_product_attention.
FastAttnProcessor follows modules/fast_attn_processor.py (full_attn step caches the residual,
residual_window_attn step reuses it). 32 image tokens, window 4: with the bug token 20 sees
tokens 0..24 in the windowed call, with the fix 16..24.
"""
import argparse
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1)):
    """Torch port of flash_attn.flash_attn_func; q, k, v are (batch, seqlen, nheads, headdim).

    If window_size != (-1, -1), query i attends to keys in [i - window_size[0], i + window_size[1]]
    inclusive; a negative side is unbounded, as in the CUDA kernel.
    """
    seqlen_q, seqlen_k = q.shape[1], k.shape[1]
    i = torch.arange(seqlen_q)[:, None]
    j = torch.arange(seqlen_k)[None, :]
    left, right = window_size
    if causal:
        right = 0
    mask = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool)
    if left >= 0:
        mask &= j >= i - left
    if right >= 0:
        mask &= j <= i + right
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
        attn_mask=mask, dropout_p=dropout_p, scale=softmax_scale,
    )
    return out.transpose(1, 2)


class Attention(nn.Module):
    """The slice of diffusers' Attention the processor touches."""

    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.to_q = nn.Linear(dim, dim)
        self.to_k = nn.Linear(dim, dim)
        self.to_v = nn.Linear(dim, dim)
        self.to_out = nn.ModuleList([nn.Linear(dim, dim), nn.Dropout(0.0)])
        self.stepi = 0
        self.cached_residual = None
        self.processor = None

    def forward(self, hidden_states):
        return self.processor(self, hidden_states)


class FastAttnProcessor:
    def __init__(self, window_size, steps_method):
        self.window_size = window_size
        self.steps_method = steps_method
        self.need_compute_residual = self.compute_need_compute_residual(steps_method)

    def compute_need_compute_residual(self, steps_method):
        need_compute_residual = []
        for i, method in enumerate(steps_method):
            need = False
            if "full_attn" in method:
                for j in range(i + 1, len(steps_method)):
                    if "residual_window_attn" in steps_method[j]:
                        need = True
                    if "full_attn" in steps_method[j]:
                        break
            need_compute_residual.append(need)
        return need_compute_residual

    def __call__(self, attn, hidden_states):
        method = self.steps_method[attn.stepi]
        batch_size = hidden_states.shape[0]
        query = attn.to_q(hidden_states)
        key = attn.to_k(hidden_states)
        value = attn.to_v(hidden_states)
        head_dim = key.shape[-1] // attn.heads
        query = query.view(batch_size, -1, attn.heads, head_dim)
        key = key.view(batch_size, -1, attn.heads, head_dim)
        value = value.view(batch_size, -1, attn.heads, head_dim)
        if "full_attn" in method:
            all_hidden_states = flash_attn_func(query, key, value)
            if self.need_compute_residual[attn.stepi]:
                w_hidden_states = flash_attn_func(query, key, value, window_size=self.window_size)
                attn.cached_residual = all_hidden_states - w_hidden_states
            hidden_states = all_hidden_states
        elif "residual_window_attn" in method:
            w_hidden_states = flash_attn_func(query, key, value, window_size=self.window_size)
            hidden_states = w_hidden_states + attn.cached_residual[:batch_size].view_as(w_hidden_states)
        hidden_states = hidden_states.reshape(batch_size, -1, attn.heads * head_dim)
        hidden_states = attn.to_out[1](attn.to_out[0](hidden_states))
        attn.stepi += 1
        return hidden_states


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--window_size", type=int, default=4)
    parser.add_argument("--n_steps", type=int, default=3)
    args, _ = parser.parse_known_args()

    torch.manual_seed(0)
    attn = Attention(dim=32, heads=2)
    steps_method = ["full_attn"] + ["residual_window_attn"] * (args.n_steps - 1)
    if FIXED:
        window_size = [args.window_size, args.window_size]
    else:
        window_size = [-args.window_size, args.window_size]
    attn.processor = FastAttnProcessor(window_size=window_size, steps_method=steps_method)

    latents = torch.randn(1, 32, 32)  # 32 image patch tokens
    with torch.no_grad():
        for _ in range(args.n_steps):
            latents = latents + 0.1 * attn(latents)
    print(f"window_size={window_size} latents norm {latents.norm():.4f}")


if __name__ == "__main__":
    main()
