"""Which field each attention path reads, and the mask it builds from it, as a maskcli expression.

The paths, as their code reads a batch (transformers 4.5x-5.x, flash-attn 2, TransformerEngine, torchtitan):

- hf-sdpa: transformers' create_causal_mask for sdpa, eager and flex_attention. A 4-D attention_mask is
  used as given; a 2-D one gives causal & padding, and then position_ids are NOT read; with no
  attention_mask and no cache, position_ids that do not go up by 1 start a document
  (find_packed_sequence_indices). With use_cache=True (the configs' default) the model makes a DynamicCache
  before it builds the mask, and a mask with a cache reads no position_ids: plain causal.
- hf-flash: transformers' flash_attention_2 (_flash_attention_forward). A 2-D attention_mask with padding
  unpads each row into one sequence (position_ids and cu_seq_lens_* ignored; an all-ones mask is dropped
  first, by flash_attention_mask); else cu_seq_lens_q/k with max_length_q/k (all four); else, for one
  batch row, position_ids equal to their minimum start documents.
- varlen: flash_attn_varlen_func (or TransformerEngine's THD layout) called on the batch's cu_seqlens.
- eos: a document mask keyed on an EOS id (torchtitan's flex document mask, attention-gym): a document
  ends at each EOS token, whatever the other fields say.

Each mask is made from its kind bound to the documents' sizes (terms.bound), at the batch's positions with its
padding (mask.from_terms), so it is exact on intervals; its expression and options are written only to be shown
(`Path.command`, the name a difference gives it), never parsed back.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace

import numpy as np

from maskcli import terms
from maskcli.batchdata import with_padding
from maskcli.intervals import Intervals
from maskcli.kinds import get as get_kind
from maskcli.kinds.values import from_sizes, rows_text
from maskcli.mask import Mask, MaskOptions, from_tensor, from_terms
from maskcli.pack import boundaries as bd
from maskcli.pack.fields import Batch
from maskcli.positions import Frame

TITLES = {
    "hf-sdpa": "transformers sdpa / eager / flex_attention",
    "hf-flash": "transformers flash_attention_2",
    "varlen": "flash_attn_varlen_func with cu_seqlens",
    "eos": "document mask on the EOS id",
}


@dataclass(frozen=True)
class Model:
    """What the transformers model is called with, as far as it shapes the mask: use_cache, and where that was read."""

    use_cache: bool = True
    said_by: str = "the default of LlamaConfig and most configs"
    stated: bool = False  # the user said it (--use-cache): a path's leak under it is wrong, not a condition

    @property
    def text(self) -> str:
        return f"use_cache={self.use_cache} ({self.said_by})"


# where transformers 5.x decides it (site-packages/transformers/...): with a cache, no packed mask
CACHE_RULE = ("with use_cache=True the model makes a DynamicCache, and transformers builds the packed-sequence mask "
              "from position_ids only with no cache; --use-cache no if the model runs with use_cache=False (as "
              "transformers' Trainer sets it by default)")


@dataclass(frozen=True, eq=False)
class Path:
    """One attention path: the field it reads and the mask that results (None: the path does not apply)."""

    name: str
    reads: str  # the field, in words: "position_ids", "attention_mask (2-D)", "nothing"
    expression: str | None  # the maskcli expression (with `options` for its padding)
    options: MaskOptions | None
    mask: Mask | None
    notes: list[str] = field(default_factory=list)
    # (the first token a sequence starts at, the position_id that starts one) where the path never computes the
    # tokens before it: checks/packing.py's left-out says so
    left_out: tuple[int, int] | None = None
    condition: str | None = None  # what its mask rests on that pack cannot see and nobody stated (a leak is then suspicious)

    @property
    def title(self) -> str:
        return TITLES[self.name]

    @property
    def applies(self) -> bool:
        return self.mask is not None

    def intervals(self) -> Intervals:
        """Exact key intervals per (batch row, query); a 4-D mask's cells are read into runs."""
        if self.mask.tree is not None:
            return self.mask.intervals()
        from maskcli.kinds.padding import key_runs

        keep = self.mask.keep[:, 0]
        rows, length = keep.shape[0], keep.shape[1]
        found = key_runs(keep.reshape(rows * length, -1), self.mask.frame, "the 4-D attention_mask")
        return Intervals(found.starts.reshape(rows, length, -1), found.ends.reshape(rows, length, -1), 0, length)

    def command(self) -> str | None:
        """The maskcli command that shows this mask (None where it is a tensor)."""
        if self.expression is None or self.options is None:
            return None
        from maskcli.text import shell_quote

        words = ["maskcli", "show", shell_quote(self.expression)]
        o = self.options
        if o.length is not None and not _fixes_length(self.expression):
            words += ["--len", str(o.length)]
        if o.lengths is not None:
            words += ["--lengths", o.lengths]
        if o.ids is not None:
            words += ["--ids", shell_quote(o.ids), "--pad-id", "0"]
        return " ".join(words)


def _fixes_length(expression: str) -> bool:
    return "sizes=" in expression


def with_padding_runs(starts: np.ndarray, pad: np.ndarray) -> np.ndarray:
    """Starts with each padding run, and the token after it, starting a document: padding is nobody's document."""
    out = starts.copy()
    edge = np.zeros(pad.shape, dtype=bool)
    edge[:, 1:] = pad[:, 1:] != pad[:, :-1]
    out |= edge
    out[:, 0] = True
    return out


def padding_options(pad: np.ndarray | None, length: int) -> dict:
    """MaskOptions fields for key padding, to be shown: --lengths where each row's padding is at its end, else --ids
    (1 = token, pad 0)."""
    if pad is None or not pad.any():
        return {}
    return dict(_padding_text(np.packbits(pad, axis=1).tobytes(), pad.shape))


@functools.lru_cache(maxsize=2)
def _padding_text(packed: bytes, shape: tuple[int, int]) -> tuple:
    """Written once per padding: --ids of 1M tokens is a long text to write (it is shown, never read back)."""
    rows, length = shape
    pad = np.unpackbits(np.frombuffer(packed, dtype=np.uint8).reshape(rows, -1), axis=1, count=length).astype(bool)
    lengths = _end_lengths(pad)
    if lengths is not None:
        return (("lengths", ",".join(map(str, lengths))),)
    return (("ids", rows_text((~pad).astype(np.int64))), ("pad_id", 0))


def _end_lengths(pad: np.ndarray) -> tuple[int, ...] | None:
    """Each row's real tokens where every row's padding is at its end (what --lengths says), else None."""
    real = (~pad).sum(axis=1)
    if np.array_equal(pad, np.arange(pad.shape[1])[None, :] >= real[:, None]):
        return tuple(real.tolist())
    return None


def frame(length: int, pad: np.ndarray | None) -> Frame:
    """The batch's positions with its key padding, as --lengths or --ids would place them (batchdata.with_padding),
    from the padding itself: nothing written to be read back."""
    plain = Frame(0, length, 0, length)
    if pad is None or not pad.any():
        return plain
    lengths = _end_lengths(pad)
    if lengths is not None:
        return with_padding(plain, lengths, None, 0)
    return with_padding(plain, None, (~pad).astype(np.int64), 0)


def documents(kind: str, starts: np.ndarray, pad: np.ndarray | None) -> tuple[terms.Term, MaskOptions]:
    """`document(sizes=[...])` (or `causal` where each row is one document) as a term bound to the sizes, and the
    options that show its padding."""
    length = starts.shape[1]
    if pad is not None:
        starts = with_padding_runs(starts, pad)
    if starts[:, 1:].any():
        sizes = [np.diff(np.append(np.flatnonzero(row), length)) for row in starts]
        term = terms.bound(get_kind(kind), {"labels": from_sizes(sizes, f"{kind}(sizes=...)")})
    else:
        term = terms.bound(get_kind("causal" if kind == "document" else "full"), {})
    return term, MaskOptions(length=length, **padding_options(pad, length))


def documents_mask(kind: str, starts: np.ndarray, pad: np.ndarray | None) -> Mask:
    """The Mask of `documents`, at the batch's positions with its padding."""
    term, _ = documents(kind, starts, pad)
    return from_terms(term, frame(starts.shape[1], pad))


def _built(name: str, reads: str, term: terms.Term, options: MaskOptions, pad: np.ndarray | None, notes: list[str]) -> Path:
    text = terms.text(term)
    return Path(name, reads, text, options, _mask(term, text, options, pad), notes)


_MASKS: dict[tuple, Mask] = {}  # cleared by every_path: shared within one check, never across batches


def _mask(term: terms.Term, text: str, options: MaskOptions, pad: np.ndarray | None) -> Mask:
    """One Mask per expression and padding: paths that read the same field share it (and its intervals)."""
    key = (text, options.length, options.lengths, options.ids)
    if key not in _MASKS:
        _MASKS[key] = from_terms(term, frame(options.length, pad))
    return _MASKS[key]


def _causal(name: str, reads: str, pad, length: int, notes: list[str]) -> Path:
    options = MaskOptions(length=length, **padding_options(pad, length))
    return _built(name, reads, terms.bound(get_kind("causal"), {}), options, pad, notes)


def _packed(positions: np.ndarray) -> bool:
    """HF's _is_packed_sequence: position_ids that are not one run counting up from their minimum."""
    flat = positions.reshape(-1)
    return bool(np.any(flat != np.arange(flat.size) + flat.min()))


def hf_sdpa(batch: Batch, fields: dict[str, bd.Boundaries], model: Model) -> Path:
    f, length = batch.fields, batch.length
    if batch.keep_4d is not None:
        keep = np.ascontiguousarray(np.broadcast_to(batch.keep_4d, (batch.rows, 1, length, length)))
        mask = from_tensor(keep, "the 4-D attention_mask")
        b = fields["attention_mask"]
        term, options = documents("document", b.starts, b.pad)
        rebuilt = from_terms(term, frame(length, b.pad))
        from maskcli.diff import compare

        if compare(rebuilt, mask, first=0).equal:
            return Path("hf-sdpa", "attention_mask (4-D)", terms.text(term), options, rebuilt, ["the 4-D mask is used as given; this expression rebuilds it exactly"])
        return Path("hf-sdpa", "attention_mask (4-D)", None, None, mask, ["the 4-D mask is used as given; no document expression rebuilds it"])
    notes = []
    if "attention_mask" in f:
        if "position_ids" in f and _restarts(f["position_ids"]):
            notes.append("position_ids restart but are not read: transformers builds a packed-sequence mask from "
                         "position_ids only when no attention_mask is passed")
        if f["attention_mask"].max(initial=0) > 1:
            notes.append("the document ids in attention_mask are read as 1 (a token): only their 0s mask")
        return _causal("hf-sdpa", "attention_mask (2-D)", fields["attention_mask"].pad, length, notes)
    if "position_ids" in f and model.use_cache:
        if _restarts(f["position_ids"]):
            notes.append("position_ids restart but are not read: " + CACHE_RULE)
        path = _causal("hf-sdpa", "nothing (use_cache=True)", None, length, notes)
        # a training batch runs with use_cache=False (Trainer's default) and is read right: the cache is a condition
        return path if model.stated or not _restarts(f["position_ids"]) else replace(
            path, condition=f"the model runs with use_cache=True ({model.said_by}; --use-cache yes or no says which)")
    if "position_ids" in f:
        term, options = documents("document", fields["position_ids"].starts, None)
        return _built("hf-sdpa", "position_ids", term, options, None, notes)
    if batch.mrope is not None:
        notes.append("mRoPE position_ids (3, B, L) are not read for packing: the mask is causal")
    path = _causal("hf-sdpa", "nothing (no attention_mask, no position_ids)", None, length, notes)
    served = [name for name in ("cu_seq_lens_q", "cu_seqlens", "seq_idx") if name in f]  # documents for another path only
    return replace(path, condition=f"the model runs sdpa, eager or flex_attention, which read no {served[0]}") if served else path


def _restarts(positions: np.ndarray) -> bool:
    return bool((np.diff(positions, axis=1) != 1).any())


def hf_flash(batch: Batch, fields: dict[str, bd.Boundaries], model: Model) -> Path:
    f, length = batch.fields, batch.length
    if batch.keep_4d is not None:
        return Path("hf-flash", "attention_mask (4-D)", None, None, None, ["does not apply: flash_attention_2 takes no 4-D mask"])
    notes = []
    varlen = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
    if "attention_mask" in f and (f["attention_mask"] == 0).any():
        ignored = [name for name in ("position_ids", "cu_seq_lens_q", "cu_seq_lens_k") if name in f]
        if ignored and ("position_ids" not in ignored or _restarts(f["position_ids"]) or len(ignored) > 1):
            notes.append(f"{' and '.join(ignored)} ignored: with an attention_mask that holds padding, flash_attention_2 unpads "
                         "each row into one sequence, so packed samples see each other")
        return _causal("hf-flash", "attention_mask (2-D)", fields["attention_mask"].pad, length, notes)
    if "attention_mask" in f:
        notes.append("the attention_mask holds no padding, so transformers drops it for flash_attention_2 (flash_attention_mask)")
    for name in varlen:
        if name in f and not batch.spelled(name):
            notes.append(f"{batch.sources[name]} is not read: transformers takes it only as {name} (--field {name}={batch.sources[name]} says it is)")
    given = [name for name in varlen if name in f and batch.spelled(name)]
    if len(given) == len(varlen):
        b = fields["cu_seq_lens_q"]
        if not np.array_equal(f["cu_seq_lens_q"], f["cu_seq_lens_k"]):
            notes.append("cu_seq_lens_q and cu_seq_lens_k differ: flash_attn_varlen_func pairs query document i with key document i "
                         "(causal from the bottom right); this mask follows cu_seq_lens_q's documents, which is exact only where they agree")
        term, options = documents("document", b.starts, b.pad)
        return _built("hf-flash", "cu_seq_lens_q/k, max_length_q/k", term, options, b.pad, notes)
    if given:
        notes.append(f"{', '.join(given)} given but not {', '.join(n for n in varlen if n not in given)}: "
                     "flash_attention_2 reads them only when all four are passed")
    if "cu_seqlens" in f:
        notes.append("cu_seqlens is not read: transformers' flash_attention_2 takes cu_seq_lens_q and cu_seq_lens_k")
    if "position_ids" in f:
        positions = f["position_ids"]
        if batch.rows == 1 and _packed(positions):
            flat = positions.reshape(-1)
            starts = (flat == flat.min()).reshape(positions.shape)
            first = int(np.argmax(flat == flat.min()))
            starts[:, 0] = True
            term, options = documents("document", starts, None)
            path = _built("hf-flash", "position_ids (equal to their minimum)", term, options, None, notes)
            if first == 0:
                return path
            # prepare_fa_kwargs_from_position_ids: cu_seq_lens_q = [indices where position_ids == min, total], so the
            # tokens before the first minimum are in no sequence and flash_attn_varlen_func computes nothing for them.
            return replace(path, left_out=(first, int(flat.min())))
        if batch.rows > 1 and _restarts(positions):
            notes.append("position_ids restart but are not read: flash_attention_2 reads packed position_ids only for one batch row")
    dropped = " (the all-ones attention_mask is dropped)" if "attention_mask" in f else ""
    return _causal("hf-flash", "nothing" + dropped, None, length, notes)


def varlen(batch: Batch, fields: dict[str, bd.Boundaries], model: Model) -> Path:
    for name in ("cu_seqlens_padded", "cu_seqlens", "cu_seq_lens_q"):
        if name in fields:
            b = fields[name]
            term, options = documents("document", b.starts, b.pad)
            return _built("varlen", name if name != "cu_seqlens_padded" else "cu_seqlens_padded with cu_seqlens", term, options, b.pad,
                          list(b.notes))
    return Path("varlen", "no cu_seqlens", None, None, None, ["does not apply: the batch has no cu_seqlens"])


def eos(batch: Batch, fields: dict[str, bd.Boundaries], model: Model) -> Path:
    if "eos" not in fields:
        return Path("eos", "no --eos-id", None, None, None, ["does not apply: give --eos-id to check a document mask keyed on EOS"])
    term, options = documents("document", fields["eos"].starts, None)
    return _built("eos", "input_ids", term, options, None, [])


def every_path(batch: Batch, fields: list[bd.Boundaries], model: Model) -> list[Path]:
    by_name = {b.name: b for b in fields}
    _MASKS.clear()  # shared within one check, never across batches
    _padding_text.cache_clear()
    return [build_path(batch, by_name, model) for build_path in (hf_sdpa, hf_flash, varlen, eos)]
