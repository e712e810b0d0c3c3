"""Reading a packed batch: its fields from a file (.pt, .safetensors, .npz, .json) or from options.

A field is known by the names Hugging Face, TRL, torchtitan and TransformerEngine give it
(`cu_seq_lens_q` and `cu_seqlens_q` are one field); `--field NAME=KEY` maps any other key.
Per-token fields become int64 (B, L) arrays; a 1-D field is one batch row, and position_ids
of one row serve every batch row (HF expands them). mRoPE position_ids (3, B, L) are rotary
positions per axis, not packing; (4, B, L) carries the text positions first (Qwen2-VL).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from maskcli.errors import MaskError
from maskcli.text import names_text, shortened

# canonical name -> the keys read as it, in order
ALIASES: dict[str, tuple[str, ...]] = {
    "input_ids": ("input_ids", "tokens", "input"),
    "position_ids": ("position_ids", "positions", "pos_ids"),
    "attention_mask": ("attention_mask", "attn_mask"),
    "cu_seqlens": ("cu_seqlens", "cu_seq_lens"),
    "cu_seq_lens_q": ("cu_seq_lens_q", "cu_seqlens_q"),
    "cu_seq_lens_k": ("cu_seq_lens_k", "cu_seqlens_k", "cu_seqlens_kv"),
    "cu_seqlens_padded": ("cu_seqlens_padded", "cu_seqlens_q_padded", "cu_seqlens_kv_padded"),
    "max_length_q": ("max_length_q", "max_seqlen_q", "max_seqlen"),
    "max_length_k": ("max_length_k", "max_seqlen_k", "max_seqlen_kv"),
    "seq_idx": ("seq_idx", "document_ids", "doc_ids"),
    "labels": ("labels", "label"),
}
CUMULATIVE = ("cu_seqlens", "cu_seq_lens_q", "cu_seq_lens_k", "cu_seqlens_padded")
SCALARS = ("max_length_q", "max_length_k")
PER_TOKEN = ("input_ids", "position_ids", "seq_idx", "labels")
# what the whole check holds at its peak per token of the batch: 150 to 205 bytes measured with tracemalloc on
# 1M-token batches (cu_seqlens alone; every field with an attention_mask), with room to spare
BYTES_PER_TOKEN = 256


@dataclass(frozen=True)
class Batch:
    """A packed batch: B rows of L tokens and the fields that describe them (numpy, int64 unless said)."""

    rows: int
    length: int
    fields: dict[str, np.ndarray]  # input_ids, labels, seq_idx, position_ids, attention_mask: (B, L); cu_*: (N+1,)
    sources: dict[str, str]  # canonical name -> the key (or option) it was read from
    keep_4d: np.ndarray | None = None  # a 4-D attention_mask as bool keep (B, 1, L, L)
    mask_convention: str | None = None  # how the 4-D mask was read
    mrope: np.ndarray | None = None  # (3, B, L) rotary positions per axis, when position_ids were mRoPE
    notes: list[str] = field(default_factory=list)

    @property
    def tokens(self) -> int:
        return self.rows * self.length

    def has(self, name: str) -> bool:
        return name in self.fields

    def spelled(self, name: str) -> bool:
        """The field is under its own name (HF's kwargs), or the user said what it is (an option, --field)."""
        source = self.sources.get(name, name)
        return source == name or source.startswith("--") or source.endswith("via --field")

    def where(self, name: str) -> str:
        """'position_ids' or 'position_ids (from key "pos")': how a field is named in messages."""
        source = self.sources.get(name, name)
        return name if source == name else f"{name} (from {source})"


def canonical(key: str) -> str | None:
    for name, keys in ALIASES.items():
        if key in keys:
            return name
    return None


def parse_field_maps(maps: list[str]) -> dict[str, str]:
    """--field NAME=KEY: {key: canonical name}."""
    out = {}
    for text in maps:
        name, sep, key = text.partition("=")
        name, key = name.strip(), key.strip()
        if not sep or not name or not key:
            raise MaskError(f"--field {text!r}: write NAME=KEY, like position_ids=pos (the field, then the key in the file)")
        if name not in ALIASES:
            raise MaskError(f"--field {text!r}: {name!r} is not a field maskcli reads; the fields are {', '.join(ALIASES)}")
        out[key] = name
    return out


def _numbers(tensor, where: str) -> np.ndarray:
    """A torch tensor (or array) as numpy int64, refusing floats that are not whole numbers."""
    if _is_torch(tensor):
        import torch

        from maskcli.tensorfile import without_plain_values

        kind = without_plain_values(tensor)
        if kind is not None:
            raise MaskError(f"{where} is {kind}; a batch's fields are plain integers: save a dense tensor (.to_dense(), .dequantize())")
        if tensor.is_complex():
            raise MaskError(f"{where} holds complex numbers; give integers")
        unsigned = tensor.dtype in (torch.uint16, torch.uint32, torch.uint64)  # kept, so a uint64 past int64 is seen, not wrapped
        array = tensor.detach().cpu().to(torch.float64 if tensor.is_floating_point() else tensor.dtype if unsigned else torch.int64).numpy()
    else:
        array = np.asarray(tensor)
    if array.dtype.kind == "u" and array.size and array.max() > np.iinfo(np.int64).max:
        raise MaskError(f"{where} holds {int(array.max())}, past int64 ({np.iinfo(np.int64).max:,}): give indices and lengths that fit int64")
    if array.dtype.kind == "f":
        bad = ~np.isfinite(array) | (array != np.round(array)) | (np.abs(array) >= 2.0**63)
        if bad.any():
            raise MaskError(f"{where} holds {float(array.ravel()[np.argmax(bad.ravel())])!r}, not a whole number; give integers")
        array = array.astype(np.int64)
    if array.dtype.kind == "b":
        array = array.astype(np.int64)
    return np.ascontiguousarray(array.astype(np.int64))


def read(path: str | None, given: dict[str, str], maps: list[str]) -> Batch:
    """The batch in `path` (None: options only) with the fields `given` as option text overriding the file's."""
    raw: dict[str, object] = {}
    sources: dict[str, str] = {}
    named = parse_field_maps(maps)
    if path is not None:
        from maskcli.tensorfile import load_tensors

        # float64: a JSON float is a whole number or refused (_numbers), and float32 rounds one past 2^24 to another
        tensors = load_tensors(path, "BATCH", json_floats="float64", numbers=True, work=(BYTES_PER_TOKEN, "to check as a batch"))
        if not tensors or set(tensors) == {""}:
            raise MaskError(f"BATCH {path!r} holds one unnamed tensor; save a dict of named tensors (input_ids, position_ids, cu_seqlens, ...)")
        missing = [key for key in named if key not in tensors]
        if missing:
            raise MaskError(f"--field names key {missing[0]!r}, which BATCH {path!r} does not hold; it holds {names_text(tensors)}")
        for key in tensors:  # (an .npz's members are unpacked only where they are fields)
            name = named.get(key) or (canonical(key) if key not in named.values() else None)
            if name is None or (name in raw and key not in named):
                continue
            raw[name], sources[name] = tensors[key], (f"{key} via --field" if key in named else key)
        if not raw:
            raise MaskError(f"BATCH {path!r} holds {names_text(tensors)}, none of them a field maskcli reads "
                            f"({', '.join(ALIASES)}); map one with --field NAME=KEY")
    for name, text in given.items():
        raw[name], sources[name] = _from_option(name, text), "--" + name.replace("_", "-")
    if not raw:
        raise MaskError("no batch: give a BATCH file, or fields as options like --position-ids 0,1,2,0,1 or --cu-seqlens 0,3,5")
    return from_arrays(raw, sources)


def _from_option(name: str, text: str) -> np.ndarray:
    from maskcli.kinds.values import parse_rows

    flag = "--" + name.replace("_", "-")
    if name == "attention_mask" and text.lstrip().startswith("["):
        from maskcli.tensorfile import read_tensors

        # the reader of every tensor file's JSON: numbers past int64, "inf" and text are one line there
        return read_tensors(text, flag)[""]
    rows = parse_rows(text, f"{flag} {shortened(text, 60)!r}", "0,3,5" if name in CUMULATIVE else "0,1,2,0,1")
    if name in CUMULATIVE + SCALARS:
        if len(rows) > 1:
            raise MaskError(f"{flag} {shortened(text, 60)!r}: one list over the flattened batch, without ';'")
        if name in SCALARS and rows[0].size != 1:
            raise MaskError(f"{flag} {shortened(text, 60)!r}: one number, the longest document's length (like 5)")
        return rows[0] if name in CUMULATIVE else rows[0].reshape(())
    widths = {len(row) for row in rows}
    if len(widths) > 1:
        raise MaskError(f"{flag} {shortened(text, 60)!r}: the batch rows have different lengths; give every row one value per token")
    return np.stack(rows)


def from_arrays(raw: dict, sources: dict[str, str]) -> Batch:
    """A Batch from tensors or arrays under their canonical names (`sources`: where each came from, for messages)."""
    arrays = {name: _numbers(value, sources[name]) if name != "attention_mask" else value for name, value in raw.items()}
    notes: list[str] = []
    mrope = None
    if "position_ids" in arrays and arrays["position_ids"].ndim == 3:
        positions = arrays.pop("position_ids")
        if positions.shape[0] == 4:  # Qwen2-VL: text positions first, then the three mRoPE axes
            arrays["position_ids"], mrope = positions[0], positions[1:]
            notes.append("position_ids are (4, B, L): row 0 holds the text positions, which HF reads for packing; rows 1-3 are mRoPE")
        elif positions.shape[0] == 3:
            mrope = positions
            notes.append("position_ids are mRoPE (3, B, L): rotary positions per axis (time, height, width), not packing; "
                         "HF builds no packed mask from them (pass (4, B, L) with text positions first for that)")
        else:
            raise MaskError(f"{sources['position_ids']} has shape {list(positions.shape)}: 3-D position_ids are mRoPE (3, B, L) or (4, B, L)")
    for name, array in arrays.items():
        if name in PER_TOKEN and name != "attention_mask":
            if array.ndim == 1:
                arrays[name] = array[None, :]
            elif array.ndim != 2:
                raise MaskError(f"{sources[name]} has shape {list(array.shape)}: {name} is (B, L) or (L,)")
        elif name in CUMULATIVE and array.ndim != 1:
            if array.ndim == 2 and array.shape[0] == 1:  # a collator's batch dimension of 1
                arrays[name] = array[0]
            else:
                raise MaskError(f"{sources[name]} has shape {list(array.shape)}: {name} is one list (N+1,) over the flattened batch")
        elif name in SCALARS and array.size != 1:
            raise MaskError(f"{sources[name]} has shape {list(array.shape)}: {name} is one number")
    keep_4d = convention = None
    if "attention_mask" in arrays:
        arrays["attention_mask"], keep_4d, convention = _attention_mask(arrays["attention_mask"], sources["attention_mask"])
        if keep_4d is not None:
            del arrays["attention_mask"]
    rows, length = _size(arrays, keep_4d, mrope, sources)
    _check_fits(rows, length, arrays, sources)
    for name in PER_TOKEN + ("attention_mask",):
        if name in arrays and arrays[name].shape[0] == 1 and rows > 1:
            arrays[name] = np.broadcast_to(arrays[name], (rows, length))  # HF expands unsqueezed position_ids too
    for name in CUMULATIVE:
        if name in arrays:
            _check_cumulative(arrays[name], sources[name], rows * length)
    return Batch(rows, length, arrays, sources, keep_4d, convention, mrope, notes)


def _is_torch(value) -> bool:
    """A torch tensor, told without importing torch (options and .npz batches need only numpy)."""
    return type(value).__module__.startswith("torch")


def _attention_mask(value, where: str):
    """(2-D int64 mask or None, 4-D keep or None, the 4-D mask's convention)."""
    if (value.dim() if _is_torch(value) else np.ndim(value)) in (1, 2):
        array = value.detach().cpu().double().numpy() if _is_torch(value) and value.is_floating_point() else value
        if not _is_torch(array) and np.asarray(array).dtype.kind == "f" and (np.asarray(array) < 0).any():
            from maskcli.inspect.polarity import SENTINEL_AT_MOST  # additive 0 / -inf (or finfo.min): 0 is real

            array = np.isfinite(array) & (np.asarray(array) > SENTINEL_AT_MOST)
        array = _numbers(array, where)
        array = array[None, :] if array.ndim == 1 else array
        if array.min(initial=0) < 0:
            raise MaskError(f"{where}: a 2-D attention_mask holds 1 (or a document id) for real tokens and 0 for padding; it holds {int(array.min())}")
        return array, None, None
    value = value if _is_torch(value) else np.asarray(value)
    if len(value.shape) != 4:
        raise MaskError(f"{where} has shape {list(value.shape)}: attention_mask is 2-D (B, L) or 4-D (B, 1, L, L)")
    from maskcli.inspect.polarity import check_maskable, classify, to_keep

    values = check_maskable(value, where)  # numpy from here on
    convention = classify(values, where)
    if convention.name == "bias" or not convention.sure:
        raise MaskError(f"{where}: cannot read the 4-D attention_mask as a mask ({convention.note}); save it as bool, True = may attend")
    if values.shape[-1] != values.shape[-2]:
        raise MaskError(f"{where} has shape {list(values.shape)}: a packed batch's 4-D mask is (B, 1, L, L), queries and keys the same tokens")
    keep = to_keep(values, convention)[:, :1]
    return None, np.ascontiguousarray(keep), convention.note


def _size(arrays: dict, keep_4d, mrope, sources) -> tuple[int, int]:
    """(B, L) that every per-token field agrees on (a field of one row serves every row)."""
    shapes = {name: arrays[name].shape for name in PER_TOKEN + ("attention_mask",) if name in arrays}
    if keep_4d is not None:
        shapes["attention_mask"] = (keep_4d.shape[0], keep_4d.shape[-1])
    if mrope is not None and "position_ids" not in arrays:
        shapes["position_ids"] = mrope.shape[1:]
    if not shapes:
        cu = next((arrays[n] for n in CUMULATIVE if n in arrays), None)
        if cu is None:
            raise MaskError("no per-token field: give input_ids, position_ids, attention_mask, seq_idx, labels or cu_seqlens")
        total = int(cu[-1]) if len(cu) else 0
        if total == 0:
            name = next(n for n in CUMULATIVE if n in arrays)
            raise MaskError(f"{sources.get(name, name)} {shortened(','.join(map(str, cu[:8].tolist())), 60)!r} ends at 0: the batch has "
                            f"no tokens; cumulative lengths end at the total, like 0,3,5")
        return 1, total
    lengths = {shape[1] for shape in shapes.values()}
    rows = {shape[0] for shape in shapes.values()} - {1}
    if len(lengths) > 1 or len(rows) > 1:
        listed = ", ".join(f"{sources.get(n, n)} {list(s)}" for n, s in shapes.items())
        raise MaskError(f"the fields do not agree on (B, L): {listed}; give every per-token field the same shape")
    rows_n, length = (rows.pop() if rows else 1), lengths.pop()
    if length == 0:
        raise MaskError("the batch has no tokens (L = 0)")
    if rows_n == 0:  # every padding and document reading would reduce over no rows
        empty = next(f"{sources.get(n, n)} {list(s)}" for n, s in shapes.items() if s[0] == 0)
        raise MaskError(f"the batch has no rows: {empty}; give at least one row of tokens (B >= 1)")
    return rows_n, length


def _check_fits(rows: int, length: int, arrays: dict, sources: dict[str, str]) -> None:
    """Refuse a batch whose check would not fit in memory, before anything per token is made (the size is known from
    the fields' shapes, or from where cu_seqlens ends: `--cu-seqlens 0,1000000000` is two numbers)."""
    from maskcli.memory import check_bytes_fit

    cumulative = not any(name in arrays for name in PER_TOKEN + ("attention_mask",))
    said = next((f" ({sources[n]} ends at {length:,})" for n in CUMULATIVE if n in arrays and cumulative), "")
    check_bytes_fit(rows * length * BYTES_PER_TOKEN, f"checking a batch of {rows:,} x {length:,} tokens{said}",
                    f"at about {BYTES_PER_TOKEN} bytes a token", fix="check fewer rows, or a shorter batch, at once")


def _check_cumulative(cu: np.ndarray, where: str, tokens: int) -> None:
    if cu.size < 2:
        raise MaskError(f"{where} {cu.tolist()}: cumulative lengths have N+1 entries for N documents, starting at 0, like 0,3,5")
    if cu[0] != 0:
        raise MaskError(f"{where} {shortened(str(cu.tolist()), 60)}: cumulative lengths start at 0 (like 0,3,5), this starts at {int(cu[0])}")
    down = np.flatnonzero(np.diff(cu) < 0)
    if down.size:
        i = int(down[0])
        raise MaskError(f"{where}: cumulative lengths go down at entry {i + 1} ({int(cu[i])} then {int(cu[i + 1])}); each entry is where a document ends")
    if cu[-1] > tokens:
        raise MaskError(f"{where} ends at {int(cu[-1])}, past the batch's {tokens} tokens: the cumulative lengths cover more tokens than there are")
