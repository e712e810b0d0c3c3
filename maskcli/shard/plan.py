"""One shard report: the layout a --layout names, every mask's split under it, the cu_seqlens and the findings."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from maskcli import terms
from maskcli.checks import registry
from maskcli.errors import MaskError
from maskcli.mask import Mask
from maskcli.shard import layouts, ranks, work
from maskcli.shard.layouts import Layout

MAX_WIDTH = 1 << 40  # a stripe or block of a trillion tokens: past every mask shard takes
MAX_RANKS = 1024  # the (N, N) grid and its table of counts stay small (8 MB a copy); real CP groups are far smaller
PTRR_BLOCK = 128  # FlexAttention's default block size, which _PTRRLoadBalancer reads off the BlockMask


@dataclass(frozen=True)
class Report:
    """Everything shard shows: the layout, one split per mask (layer type), the cu_seqlens and the findings."""

    layout: Layout
    splits: list  # [(label, Split)]: the layer type or the mask's name
    te: tuple | None  # (local cu_seqlens_padded, per-rank cu_seqlens) in TransformerEngine's convention
    local: list  # per-rank cu_seqlens on its own tokens, in local order
    findings: list  # Findings of checks/shard.py, each with its rank
    notes: tuple = ()  # what --trace left out of the run, in words

    @property
    def wrong(self) -> bool:
        return bool(registry.wrong(self.findings))


def document_sizes(mask: Mask) -> np.ndarray | None:
    """The sizes of the documents a document(...) or segment(...) term of the mask labels; None where it has none."""
    if mask.tree is None:
        return None
    for term in terms.terms(mask.tree):
        if term.kind.name in ("document", "segment"):
            labels = term.values.get("labels")
            if labels is None:
                continue
            row = np.asarray(labels.array)[0][: mask.frame.q_len]
            starts = np.flatnonzero(np.r_[True, row[1:] != row[:-1]])
            return np.diff(np.r_[starts, row.size])
    return None


def parse_sizes(text: str) -> np.ndarray:
    try:
        sizes = np.array([int(v) for v in text.replace(" ", "").split(",") if v], dtype=np.int64)
    except ValueError:
        raise MaskError(f"--docs {text!r}: give document sizes as whole numbers, like 300,500,224") from None
    except OverflowError:  # (past int64: no mask is that long)
        raise MaskError(f"--docs {text!r}: a size is past 2^63 - 1 tokens; give the sizes the mask's documents have, like 300,500,224") from None
    if sizes.size == 0 or (sizes < 1).any():
        raise MaskError(f"--docs {text!r}: give one size of at least 1 per document, like 300,500,224")
    return sizes


def make_layout(spec: str, length: int, n: int, heads: int, docs: np.ndarray | None, mask: Mask | None = None) -> Layout:
    """The layout --layout names: contiguous, headtail, per-document, striped[:W], ulysses, ptrr[:BLOCK] (from the
    mask's blocks), or a file of indices."""
    if n < 1:
        raise MaskError(f"--ranks {n}: give at least 1 rank")
    if n > length:
        raise MaskError(f"--ranks {n} is more than the mask's {length:,} tokens: give at most {length:,} ranks, or a longer --len")
    if n > MAX_RANKS:
        raise MaskError(f"--ranks {n}: shard works out an N x N ring-step grid, so it takes at most {MAX_RANKS:,} ranks")
    name, _, arg = spec.partition(":")
    if name in ("striped", "ptrr"):
        try:
            width = int(arg) if arg else (1 if name == "striped" else PTRR_BLOCK)
        except ValueError:
            raise MaskError(f"--layout {spec!r}: the {'stripe width' if name == 'striped' else 'block size'} is a whole number, like {name}:128") from None
        if width < 1:
            raise MaskError(f"--layout {spec!r}: the {'stripe width' if name == 'striped' else 'block size'} must be at least 1, like {name}:128")
        if width > MAX_WIDTH:  # stripe starts (width x stripe) would wrap int64
            raise MaskError(f"--layout {spec!r}: the {'stripe width' if name == 'striped' else 'block size'} is past {MAX_WIDTH:,} "
                            f"tokens; the mask has {length:,}: give at most that, like {name}:128")
        if name == "striped":
            return layouts.striped(length, n, width)
        return layouts.ptrr(work.touched_blocks(work.intervals_of(mask), length, width), length, n, width)
    if arg and name in layouts.NAMES:
        raise MaskError(f"--layout {spec!r}: only striped and ptrr take a size (striped:W, ptrr:BLOCK)")
    if name == "contiguous":
        return layouts.contiguous(length, n)
    if name in ("headtail", "head-tail"):
        return layouts.headtail(length, n)
    if name == "per-document":
        if docs is None:
            raise MaskError("--layout per-document needs the documents: use a mask with document(...) or segment(...), or give --docs 300,500,224")
        if int(docs.sum()) != length:
            raise MaskError(f"--docs add up to {int(docs.sum()):,} tokens but the mask has {length:,}: give sizes that cover it")
        return layouts.per_document(docs, n)
    if name == "ulysses":
        return layouts.ulysses(length, n, heads)
    return layouts.read_file(spec, length, n)


def analyse(masks: list[tuple[str, Mask]], spec: str, n: int, head_dim: int = 128, rank_masks: list[str] | None = None,
            docs: np.ndarray | None = None, traced: str | None = None) -> Report:
    """Every mask (one per layer type) under one layout, with the checks; with `traced` (a trace of every rank), the
    parts the run captured in place of the computed split (shard.traced)."""
    if head_dim < 1:
        raise MaskError(f"--head-dim {head_dim}: give the size of one attention head, at least 1, like --head-dim 128")
    first = masks[0][1]
    for _, mask in masks:
        work.check_shardable(mask)
        if mask.frame.q_len != first.frame.q_len:
            raise MaskError(f"the masks cover {first.frame.q_len:,} and {mask.frame.q_len:,} tokens: one layout splits one sequence; give them one --len")
    length = first.frame.q_len
    docs = docs if docs is not None else document_sizes(first)
    layout = make_layout(spec, length, n, first.heads, docs, first)
    found = registry.run("layout", layout)
    splits = [(label, work.split(mask, layout, head_dim)) for label, mask in masks]
    notes: list[str] = []
    if traced is not None:
        splits, more, notes = _traced(masks, layout, head_dim, traced, rank_masks)
        found += more
    for label, split in splits:
        found += registry.run("split", split, label=label if len(splits) > 1 else "")
    if rank_masks and traced is None:
        if len(masks) > 1:
            raise MaskError("--rank-mask checks one mask: give one EXPR or --mask with the ranks' files")
        found += ranks.check(first, layout, rank_masks)
    whole = docs if docs is not None else np.array([length])
    # TransformerEngine's THD split is per document; its bshd split (head-tail of the whole sequence) is one document
    te = work.te_cu_seqlens(layout, whole if layout.name == "per-document" else np.array([length])) if layout.name in ("headtail", "per-document") else None
    local = work.local_cu_seqlens(layout, np.cumsum(whole) - whole)
    return Report(layout, splits, te, local, found, tuple(notes))


def _traced(masks: list, layout: Layout, head_dim: int, path: str, rank_masks) -> tuple[list, list, list]:
    """The splits measured off a traced run's parts, one per distinct set of parts (the mask's own label where there
    is one), and each set's findings against the global mask (named by where it was read where there are several)."""
    from dataclasses import replace

    from maskcli.shard import traced

    if rank_masks:
        raise MaskError("give --trace or --rank-mask, not both: --trace reads every rank's part from the run")
    if len(masks) > 1:
        raise MaskError("--trace checks the run against one mask: give one EXPR or --mask, the mask the whole sequence attends with")
    label, mask = masks[0]
    sets, left = traced.read(path, layout)
    splits, found = [], []
    for one in sets:
        splits.append((label if len(sets) == 1 else one.label, traced.measured(mask, layout, one.parts, head_dim)))
        more = ranks.check_parts(mask, layout, one.parts)
        found += more if len(sets) == 1 else [replace(f, message=f"{one.label}: {f.message}") for f in more]
    return splits, found, [f"--trace {path}: left out {line}" for line in left]
