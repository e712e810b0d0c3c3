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
                   sdpa.to, dense=True),
            Format("mha", "torch.nn.MultiheadAttention", "any mask (dense bool, True = masked) with key_padding_mask", mha.to, dense=True),
            Format("hf", "transformers (4-D custom mask)", "any mask (dense float, finfo.min = masked), position_ids per document", hf.to, dense=True),
            Format("flex", "torch.nn.attention.flex_attention", "any mask: a BlockMask, with the mask_mod for partial blocks",
                   flex.to, read=flex.read, aliases=("blockmask",)),
            Format("flash-attn", "flash_attn (varlen)", "packed sequences with one causal / window band", flash_attn.to, read=flash_attn.read,
                   aliases=("cu_seqlens", "flash_attn")),
            Format("flashinfer", "flashinfer (ragged prefill)", "packed sequences with causal / window_left, else a bit-packed custom mask", flashinfer.to),
            Format("flashmask", "paddle flashmask_attention", "square masks hiding one run of rows per key column below and above the diagonal",
                   flashmask.to, read=flashmask.read),
            Format("magi", "MagiAttention", "any mask whose rows are few key ranges: slices of full / causal / inv-causal / bi-causal",
                   magi.to, read=magi.read),
            Format("xformers", "xformers memory_efficient_attention", "causal, local and block-diagonal (packed) masks", xformers.to),
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
