"""Every kernel format, in the order help, `--compare` and the docs list them."""

from __future__ import annotations

from maskcli.errors import MaskError
from maskcli.formats.base import Format

_FORMATS: dict[str, Format] | None = None


def formats() -> dict[str, Format]:
    global _FORMATS
    if _FORMATS is None:
        from maskcli.formats import flash_attn, flashinfer, flashmask, flex, hf, magi, mha, sdpa, xformers

        _FORMATS = {f.name: f for f in (
            Format("sdpa", "torch.nn.functional.scaled_dot_product_attention", "any mask (dense bool, True = attend); is_causal only for top-left causal",
                   sdpa.to, dense=True, version="torch 2.13"),
            Format("mha", "torch.nn.MultiheadAttention", "any mask (dense bool, True = masked) with key_padding_mask", mha.to, dense=True, version="torch 2.13"),
            Format("hf", "transformers (4-D custom mask)", "any mask (dense float, finfo.min = masked), position_ids per document", hf.to, dense=True, version="transformers 5.24"),
            Format("flex", "torch.nn.attention.flex_attention", "any mask: a BlockMask, with the mask_mod for partial blocks",
                   flex.to, read=flex.read, aliases=("blockmask",), version="torch 2.13"),
            Format("flash-attn", "flash_attn (varlen)", "packed sequences with one causal / window band", flash_attn.to, read=flash_attn.read,
                   aliases=("cu_seqlens", "flash_attn"), version="flash_attn 2.8.3"),
            Format("flashinfer", "flashinfer (ragged prefill)", "packed sequences with causal / window_left, else a bit-packed custom mask", flashinfer.to, version="flashinfer 0.6.17"),
            Format("flashmask", "paddle flashmask_attention", "square masks hiding one run of rows per key column below and above the diagonal",
                   flashmask.to, read=flashmask.read, version="paddlepaddle 3.3.1"),
            Format("magi", "MagiAttention", "any mask whose rows are few key ranges: slices of full / causal / inv-causal / bi-causal",
                   magi.to, read=magi.read, version="MagiAttention 1.1.1"),
            Format("xformers", "xformers memory_efficient_attention", "causal, local and block-diagonal (packed) masks", xformers.to, version="xformers 0.0.35"),
        )}
    return _FORMATS


def get(name: str, flag: str = "--for") -> Format:
    found = formats()
    for fmt in found.values():
        if name == fmt.name or name in fmt.aliases:
            return fmt
    raise MaskError(f"{flag} {name!r} is not a format: choose one of {', '.join(found)}")


def readable() -> list[str]:
    return [f.name for f in formats().values() if f.read is not None]
