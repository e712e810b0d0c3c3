"""What is this mask tensor? Its convention, how its shape broadcasts, which APIs take it as
is, which maskcli kind it is, and what looks wrong with it.

A structure is only ever *recognised by rebuilding*: candidate parameters are read off the
tensor (a window from the widest row, chunk labels from where rows' visible prefixes end,
...), then maskcli's own builder makes that mask and it must equal the tensor cell for cell.
So the command this module suggests always rebuilds the mask exactly.

A bool (or 0/1) tensor does not say which way round it is. A query normally sees its own
position, so the cells (q, q + Lk - Lq) -- the diagonal, bottom-right aligned -- tell keep
from block; key padding shows as whole columns hidden, and key 0 is rarely padding. Where
one reading is a known kind and the other is not, that decides it.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field

import torch

from maskcli.checks import Finding, fully_masked_rows, spans
from maskcli.errors import MaskError
from maskcli.masks import build
from maskcli.spec import MaskSpec, make_spec

SENTINEL_AT_MOST = -1e4  # a finite fill at most this negative masks (BERT's -10000.0 ... finfo.min)
STRUCTURE_CELLS = 1 << 24  # above this many cells, polarity is told from the diagonal alone
MASK_DTYPES = (
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
    torch.float16, torch.bfloat16, torch.float32, torch.float64,
)
WIDE_UNSIGNED = tuple(getattr(torch, name) for name in ("uint16", "uint32", "uint64") if hasattr(torch, name))
CAUSAL_SHAPED = ("causal", "prefill", "window", "document")  # kinds where no query sees a later key
FLAGS = {
    "length": "--len", "offset": "--offset", "window": "--window", "prefix": "--prefix", "chunks": "--chunks",
    "diagonal": "--diagonal", "means": "--means", "lengths": "--lengths", "ids": "--ids", "pad_id": "--pad-id",
    "heads": "--heads",
}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# --- loading and refusing -----------------------------------------------------------


def check_maskable(tensor: torch.Tensor, where: str) -> torch.Tensor:
    """The tensor as a plain CPU tensor of a mask dtype, or a one-line MaskError saying why it cannot be a mask."""
    if tensor.is_complex():
        raise MaskError(f"{where} holds complex numbers ({dtype_name(tensor.dtype)}), which cannot be a mask")
    if tensor.is_quantized:
        raise MaskError(f"{where} is a quantized tensor ({dtype_name(tensor.dtype)}); a mask is bool, 0/1 or float")
    if tensor.device.type == "meta":
        raise MaskError(f"{where} is a meta tensor: it has a shape but no values")
    if tensor.dim() > 4:
        raise MaskError(f"{where} has {tensor.dim()} dimensions {list(tensor.shape)}: a mask has at most 4 (B, H, Lq, Lk)")
    if tensor.dim() == 0:
        raise MaskError(f"{where} is a single number ({tensor.item()}), not a mask: a mask has shape (Lq, Lk) up to (B, H, Lq, Lk)")
    if tensor.numel() == 0:
        raise MaskError(f"{where} is empty (shape {list(tensor.shape)})")
    if tensor.layout != torch.strided:
        try:
            tensor = tensor.to_dense()
        except Exception as error:  # some layouts have no dense form for some dtypes
            raise MaskError(f"{where} is a {tensor.layout} tensor that cannot be made dense ({str(error).splitlines()[0][:120]})") from None
    if tensor.dtype in WIDE_UNSIGNED:
        if int(tensor.to(torch.float64).max()) > 1:  # only 0/1 matter; larger values are refused below anyway
            raise MaskError(f"{where} ({dtype_name(tensor.dtype)}) holds values above 1; a mask is bool, 0/1 or float")
        tensor = tensor.to(torch.int64)
    if tensor.dtype not in MASK_DTYPES:
        raise MaskError(
            f"{where} has dtype {dtype_name(tensor.dtype)}, which cannot be a mask here: "
            "use bool, an integer type or float16/bfloat16/float32/float64"
        )
    return tensor.detach().cpu()


def load_mask(source: str, key: str | None = None, flag: str = "FILE") -> tuple[torch.Tensor, str]:
    """The one tensor in `source` (the one named `key` where there are several), checked to be maskable, and its label."""
    from maskcli.tensorfile import is_inline, load_tensors

    tensors = load_tensors(source, flag)
    label = "the inline JSON" if is_inline(source) else repr(source)
    names = ", ".join(repr(k) for k in tensors if k)
    if key is not None:
        if key not in tensors:
            holds = f"it holds {names}" if names else "it holds one unnamed tensor: drop --key"
            raise MaskError(f"{label} has no tensor {key!r}; {holds}")
        tensor = tensors[key]
        label += f" [{key!r}]"
    elif len(tensors) == 1:
        tensor = next(iter(tensors.values()))
    elif not tensors:
        raise MaskError(f"{label} holds no tensors")
    else:
        raise MaskError(f"{label} holds several tensors ({names}): choose one with --key")
    return check_maskable(tensor, label), label


# --- shapes as SDPA and nn.MultiheadAttention read them ------------------------------


def sdpa_view(tensor: torch.Tensor) -> torch.Tensor:
    """The (B, H, Lq, Lk) view that SDPA's broadcasting gives: leading dimensions of size 1 are added."""
    return tensor.reshape((1,) * (4 - tensor.dim()) + tuple(tensor.shape))


def broadcast_text(tensor: torch.Tensor) -> str:
    """How the shape broadcasts to (B, H, Lq, Lk), in words."""
    shape = list(tensor.shape)
    if tensor.dim() == 1:
        return (
            f"[S={shape[0]}]: SDPA broadcasts it to (1, 1, 1, {shape[0]}), one row of keys shared by every batch row, "
            "head and query (a key padding row)"
        )
    if tensor.dim() == 2:
        return (
            f"[Lq={shape[0]}, Lk={shape[1]}] broadcasts over batch and heads to (1, 1, {shape[0]}, {shape[1]}) "
            f"(nn.MultiheadAttention's key_padding_mask would read the same shape as [B={shape[0]}, S={shape[1]}])"
        )
    if tensor.dim() == 3:
        n = shape[0]
        return (
            f"[{n}, Lq={shape[1]}, Lk={shape[2]}]: SDPA broadcasts its first dimension as {n} heads "
            f"(1, {n}, {shape[1]}, {shape[2]}), the same for every batch row; nn.MultiheadAttention reads it as "
            f"batch x heads = {n}, a different mask per batch row and head"
        )
    batch, heads, q_len, k_len = shape
    notes = [f"{name}=1 broadcasts over {what}" for name, size, what in
             (("B", batch, "the batch"), ("H", heads, "heads"), ("Lq", q_len, "queries")) if size == 1]
    return f"[B={batch}, H={heads}, Lq={q_len}, Lk={k_len}]" + (f": {', '.join(notes)}" if notes else "")


# --- conventions ---------------------------------------------------------------------


@dataclass(frozen=True)
class Convention:
    """A tensor's convention and how it was told.

    `how` is "values" (the values say it), "structure" (a bool/0-1 tensor's polarity, read
    from its structure), "guess" (weak evidence) or "cannot tell".
    """

    name: str  # keep, block, additive, min, int, bias
    how: str
    note: str
    sentinel: float | None = None  # the fill of a min-style mask
    ones_mean: str = "attend"  # int: what a 1 means, "attend" or (a triu(ones, 1) mask) "masked"

    @property
    def sure(self) -> bool:
        return self.how in ("values", "structure")


def _sentinel_name(value: float, dtype: torch.dtype) -> str:
    for candidate in (dtype, torch.float32, torch.float16, torch.bfloat16, torch.float64):
        if candidate.is_floating_point and value == torch.finfo(candidate).min:
            return f"finfo({dtype_name(candidate)}).min"
    return f"{value:g}"


def classify(tensor: torch.Tensor) -> Convention:
    """The tensor's convention from its dtype and values; a bool or 0/1 tensor's polarity from its structure."""
    if tensor.dtype == torch.bool:
        meaning, how, why = _polarity(tensor)
        if meaning is None:
            return Convention("keep", how, why)
        name = "keep" if meaning == "attend" else "block"
        return Convention(name, how, f"read as {name} (True = {'may attend' if name == 'keep' else 'masked'}): {why}")
    values = torch.unique(tensor)
    if not tensor.is_floating_point():
        if not bool(((values == 0) | (values == 1)).all()):
            shown = ", ".join(map(str, values[:6].tolist())) + (", ..." if len(values) > 6 else "")
            raise MaskError(
                f"integer values {{{shown}}} are not a 0/1 mask (masks are bool, 0/1 or float); "
                "chunk or document labels go to maskcli show chunk/document --chunks"
            )
        return _zero_one(tensor, values, "integer")
    values = values.to(torch.float64)
    if bool(torch.isnan(values).any()):
        raise MaskError(
            f"the mask holds NaN in {int(torch.isnan(tensor).sum())} cells; a float mask is 0 where attending "
            "and -inf or a large negative number where masked"
        )
    if bool((values == float("inf")).any()):
        raise MaskError("the mask holds +inf, which makes softmax NaN; a float mask is 0 where attending and -inf or a large negative number where masked")
    if bool(((values == 0) | (values == 1)).all()) and bool((values == 1).any()):
        return _zero_one(tensor, values, "float")
    masked = values[values != 0]
    if len(masked) == 0:
        return Convention("additive", "values", "every value is 0: an additive mask that masks nothing (read as 0/1, everything would be masked)")
    if bool((masked <= SENTINEL_AT_MOST).all()):
        finite = masked[torch.isfinite(masked)]
        if len(finite) == 0:
            return Convention("additive", "values", "float 0 / -inf, added to the scores")
        if len(finite) == 1 and len(masked) == 1:
            sentinel = float(finite[0])
            return Convention(
                "min", "values",
                f"float 0 / {_sentinel_name(sentinel, tensor.dtype)}, added to the scores (Hugging Face eager style)", sentinel,
            )
        fills = ", ".join(f"{v:g}" for v in masked[:4].tolist())
        return Convention(
            "additive", "values", f"float 0 and several fills ({fills}): all mask, since each is -inf or at most {SENTINEL_AT_MOST:g}",
            float(finite.min()),
        )
    lo, hi = float(values.min()), float(values.max())
    return Convention(
        "bias", "values",
        f"float values from {lo:g} to {hi:g}, not just 0 and one fill: an additive bias (ALiBi, relative positions), "
        f"not a mask; its masked cells are those at -inf or at most {SENTINEL_AT_MOST:g}",
    )


def _zero_one(tensor: torch.Tensor, values: torch.Tensor, what: str) -> Convention:
    """0/1 numbers: 1 = attend (torch.tril(torch.ones(L, L))) unless the structure says 1 = masked (triu(ones, 1))."""
    if len(values) == 2:
        meaning, how, why = _polarity(tensor != 0)
        if meaning == "masked" and how == "structure":
            return Convention(
                "int", "structure",
                f"{what} 0/1 with 1 = masked, a torch.triu(torch.ones(L, L), 1) mask: {why}", ones_mean="masked",
            )
    return Convention("int", "values", f"{what} 0/1, 1 = attend (torch.tril(torch.ones(L, L)) style)")


def _polarity(ones: torch.Tensor) -> tuple[str | None, str, str]:
    """Whether True (or 1) means attend or masked here, how that was told, and why."""
    x = sdpa_view(ones)
    if bool(x.all()) or not bool(x.any()):
        value = bool(x.flatten()[0])
        return None, "cannot tell", (
            f"every cell is {value}: read as keep {'nothing' if value else 'everything'} is masked, "
            f"read as block {'everything' if value else 'nothing'}"
        )
    q_len, k_len = x.shape[-2:]
    if x.numel() <= STRUCTURE_CELLS:
        scores = {}
        for meaning, keep in (("attend", x), ("masked", ~x)):
            structure = recognise(keep, key_padding=ones.dim() == 2)
            score = 0 if structure.kind is None else 1 if structure.kind in ("tril", "triu") else 2
            scores[meaning] = (score - int(bool(fully_masked_rows(keep).any())), structure)
        (best, (top, structure)), (_, (other, _)) = sorted(scores.items(), key=lambda item: -item[1][0])
        if top >= 2 > other or (top >= 1 and other < 0 and structure.kind is not None):
            return best, "structure", f"maskcli's {structure.kind} rebuilds it read this way; read the other way it is no known kind"
    # The diagonal cells (q, q + Lk - Lq), leaving out columns that are the same for every query (padding-like).
    offset = k_len - q_len
    diagonal = torch.diagonal(x, offset=offset, dim1=-2, dim2=-1)
    columns = torch.arange(diagonal.shape[-1]) + max(offset, 0)
    constant = (x.all(dim=-2) | ~x.any(dim=-2))[..., columns]
    informative = diagonal[~constant]
    if informative.numel():
        share = informative.float().mean().item()
        if share != 0.5:
            meaning = "attend" if share > 0.5 else "masked"
            seen = share if meaning == "attend" else 1 - share
            return meaning, "structure" if seen >= 0.9 else "guess", (
                f"{seen:.0%} of the queries see their own position (cell q, q + Lk - Lq) read this way, as queries normally do"
            )
    first = x[..., 0].float().mean().item()
    if first != 0.5:
        meaning = "attend" if first > 0.5 else "masked"
        return meaning, "guess", "the diagonal does not tell; key 0 is visible read this way, and key 0 is rarely padding"
    return None, "cannot tell", "neither the diagonal nor key 0 tells which way round it is; read as keep"


def to_keep(tensor: torch.Tensor, convention: Convention | str) -> torch.Tensor:
    """The bool keep mask (True = may attend) that `tensor` means in `convention`.

    As a name, "keep" and "block" also apply to 0/1 numbers (nonzero = attend, nonzero = masked).
    """
    if isinstance(convention, str):
        convention = Convention(convention, "values", "")
    name = convention.name
    if name == "keep" or (name == "int" and convention.ones_mean == "attend"):
        return tensor if tensor.dtype == torch.bool else tensor != 0
    if name == "block" or name == "int":
        return ~tensor if tensor.dtype == torch.bool else tensor == 0
    if name in ("additive", "min", "bias"):
        return torch.isfinite(tensor) & (tensor > SENTINEL_AT_MOST)
    raise ValueError(f"unknown convention {name!r}")


# --- which APIs take it as is --------------------------------------------------------


def api_fits(tensor: torch.Tensor, convention: Convention, key_padding: bool = False) -> list[str]:
    """For SDPA attn_mask, nn.MultiheadAttention attn_mask and key_padding_mask: yes as is, or what to do instead."""
    name, dims = convention.name, tensor.dim()
    is_float = tensor.is_floating_point()
    flip = "~mask" if tensor.dtype == torch.bool else "mask == 0"
    as_bool = "mask.bool()" if tensor.dtype != torch.bool else "mask"
    fits = []
    sdpa = "F.scaled_dot_product_attention attn_mask: "
    if key_padding and dims == 2:
        keep_form = as_bool if name in ("keep", "int") and convention.ones_mean == "attend" else flip
        sdpa += f"no as is, SDPA would read [B, S] as (Lq, Lk); pass ({keep_form})[:, None, None, :] as a [B, 1, 1, S] keep mask"
    elif name == "keep":
        sdpa += "yes, as is (True = attend)" + (", its first dimension read as heads" if dims == 3 else "")
    elif name == "block":
        sdpa += "no, SDPA reads True as attend; pass ~mask (or maskcli convert --to keep)"
    elif name in ("additive", "min", "bias"):
        sdpa += "yes, as is (added to the scores), cast to the query's dtype" + (", its first dimension read as heads" if dims == 3 else "")
    elif is_float:
        sdpa += f"no, a float mask is added to the scores, so 0/1 would mask nothing; pass {as_bool if convention.ones_mean == 'attend' else flip} as bool"
    else:
        sdpa += f"no, it takes bool or float; pass {as_bool if convention.ones_mean == 'attend' else '(mask == 0)'}"
    fits.append(sdpa)
    mha = "nn.MultiheadAttention attn_mask: "
    if dims not in (2, 3):
        mha += "no, it takes 2-D (L, S) or 3-D (B*num_heads, L, S)" + (
            "; expand heads and flatten: mask.expand(B, num_heads, L, S).flatten(0, 1)" if dims == 4 else ""
        )
    elif key_padding:
        mha += "no, a [B, S] padding mask goes to key_padding_mask"
    elif name in ("block", "additive", "min", "bias"):
        mha += "yes, as is" + (" (True = masked)" if name == "block" else " (added to the scores)")
    elif name == "keep":
        mha += "no, MHA reads True as masked; pass ~mask"
    else:
        mha += f"no, pass {'(mask == 0)' if convention.ones_mean == 'attend' else as_bool} as a bool block mask"
    fits.append(mha)
    kpm = "nn.MultiheadAttention key_padding_mask: "
    if dims == 2:
        if name in ("block", "additive", "min"):
            kpm += f"yes, if its rows are batch items ([B={tensor.shape[0]}, S={tensor.shape[1]}])"
        elif name == "keep":
            kpm += "no, True = masked there; pass ~mask"
        else:
            kpm += f"no, pass {'(mask == 0)' if convention.ones_mean == 'attend' else as_bool} (True = padding)"
        fits.append(kpm)
    elif dims == 4 and tensor.shape[1] == 1 and tensor.shape[2] == 1:
        fits.append(kpm + "no as is, it takes [B, S]; mask[:, 0, 0, :] is that" + (" (then ~ to make True = padding)" if name == "keep" else ""))
    return fits


# --- structure: which maskcli kind rebuilds it ---------------------------------------


@dataclass(frozen=True)
class Structure:
    kind: str | None  # a maskcli kind, or None when none rebuilds it exactly
    options: dict = field(default_factory=dict)  # make_spec keyword arguments
    spec: MaskSpec | None = None
    command: str | None = None
    reading: str = "mask"  # "mask" (Lq, Lk cells), "key padding [B, S]" or "key padding row"
    note: str = ""
    also: str | None = None  # another command that rebuilds it, where one reading is not enough

    @property
    def params(self) -> dict:
        return self.spec.params if self.spec is not None else {}


def command_for(kind: str, options: dict) -> str:
    """The `maskcli show` command for make_spec(kind, **options)."""
    parts = ["maskcli", "show", kind]
    for key, value in options.items():
        parts += [FLAGS[key], shlex.quote(str(value))]
    return " ".join(parts)


def _rebuild(kind: str, options: dict, keep: torch.Tensor) -> MaskSpec | None:
    """The spec when maskcli's `kind` with `options` is exactly `keep` (B, H, Lq, Lk); rows of size 1 compare by broadcasting."""
    try:
        spec = make_spec(kind, **options)
    except MaskError:
        return None
    batch, heads, q_len, k_len = keep.shape
    if spec.k_len != k_len or spec.batch not in (1, batch) or spec.heads not in (1, heads):
        return None
    if spec.q_len != q_len and q_len != 1:
        return None
    built = build(spec).materialize()
    if q_len == 1 and spec.q_len != 1:  # a [B, 1, 1, S] row stands for every query, so every built row must be it
        return spec if bool((built == keep).all()) else None
    return spec if torch.equal(built.expand(batch, heads, q_len, k_len), keep) else None


def _labels(new: torch.Tensor) -> str:
    """'0,0,1,1,2' from a bool per position saying where a new label starts (position 0 ignored)."""
    new = new.clone()
    new[0] = False
    return ",".join(map(str, torch.cumsum(new.long(), 0).tolist()))


def _padding_options(seen: torch.Tensor) -> dict:
    """--lengths where each batch row's visible keys are a prefix, else --ids (1 = real key, 0 = padding)."""
    lengths = seen.sum(dim=1)
    prefix = torch.arange(seen.shape[1])[None, :] < lengths[:, None]
    if torch.equal(prefix, seen):
        return {"lengths": ",".join(map(str, lengths.tolist()))}
    rows = ";".join(",".join("1" if v else "0" for v in row) for row in seen.tolist())
    return {"ids": rows, "pad_id": 0}


def _candidates(ref: torch.Tensor) -> list[tuple[str, dict]]:
    """Kinds and parameters read off one (Lq, Lk) keep matrix, simplest first; each is then checked by rebuilding."""
    q_len, k_len = ref.shape
    offset = k_len - q_len
    rows = ref.any(dim=1)
    positions = torch.arange(k_len)
    first = torch.where(ref, positions, k_len).min(dim=1).values  # first visible key per row (k_len: none)
    last = torch.where(ref, positions, -1).max(dim=1).values  # last visible key per row (-1: none)
    if offset > 0:
        return [("prefill", {"offset": offset, "length": q_len})]
    if offset < 0:
        return []
    candidates: list[tuple[str, dict]] = [("causal", {"length": q_len})]
    q = torch.arange(q_len)
    if bool(rows.any()):
        width = int((q - first)[rows].max()) + 1  # the widest look-back, itself included
        if 1 <= width < q_len:
            candidates.append(("window", {"length": q_len, "window": width}))
        if bool(rows[0]) and 1 < int(last[0]) + 1 <= k_len:
            candidates.append(("prefix", {"length": q_len, "prefix": int(last[0]) + 1}))
        candidates.append(("chunk", {"chunks": _labels(torch.cat([torch.tensor([False]), last[1:] != last[:-1]]))}))
        candidates.append(("document", {"chunks": _labels(torch.cat([torch.tensor([False]), first[1:] != first[:-1]]))}))
        lower = (last < k_len - 1) & rows
        if bool(lower.any()):
            row = int(lower.nonzero()[0])
            candidates.append(("tril", {"length": q_len, "diagonal": int(last[row]) - row}))
        upper = (first > 0) & rows
        if bool(upper.any()):
            row = int(upper.nonzero()[0])
            candidates.append(("triu", {"length": q_len, "diagonal": int(first[row]) - row, "means": "keep"}))
    return candidates


def recognise(keep4: torch.Tensor, key_padding: bool = False) -> Structure:
    """The maskcli kind (and options) whose mask is exactly this keep mask (B, H, Lq, Lk), or kind None.

    `key_padding`: the tensor was 2-D, so it may also be a [B, S] key padding mask; that
    reading is used when the (Lq, Lk) reading matches no kind.
    """
    batch, heads, q_len, k_len = keep4.shape
    if heads > 1 and not bool((keep4 == keep4[:, :1]).all()):
        per_head = []
        for h in range(min(heads, 8)):
            found = recognise(keep4[:, h : h + 1])
            per_head.append(f"head {h}: {found.command.removeprefix('maskcli show ') if found.kind else 'none'}")
        more = f"; {heads - 8} more" if heads > 8 else ""
        return Structure(None, note=f"the heads differ, and a maskcli kind is the same for every head ({'; '.join(per_head)}{more})")
    keep = keep4[:, :1]
    head_option = {"heads": heads} if heads > 1 else {}
    seen = keep[:, 0].any(dim=1)  # (B, Lk): keys that some query sees
    padding = _padding_options(seen) if not bool(seen.all()) else None
    ref = keep[int(seen.sum(dim=1).argmax()), 0]  # the batch row with the most keys in use

    def found(kind: str, options: dict, reading: str = "mask", note: str = "") -> Structure | None:
        options = {**options, **head_option}
        spec = _rebuild(kind, options, keep4)
        if spec is None:
            return None
        if batch > 1 and spec.batch == 1:
            note = (note + " " if note else "") + f"(the file repeats it for each of its {batch} batch rows)"
        return Structure(kind, options, spec, command_for(kind, options), reading, note)

    if q_len == 1 and k_len > 1:
        decode = found("prefill", {"offset": k_len - 1, "length": 1, **(padding or {})})
        if padding is not None:
            row = found("padding", padding, "key padding row",
                        "the query dimension is 1, so this one row of keys applies to every query")
            if row is not None:
                return Structure(**{**row.__dict__, "also": decode.command if decode else None})
        if decode is not None:
            return Structure(**{**decode.__dict__, "note": "a single decode step: the last position sees every key"})
    if bool(keep.all()) and q_len == k_len:
        full = found("padding", {"lengths": ",".join([str(k_len)] * batch)}, note="every query sees every key: nothing is masked")
        if full is not None:
            return full
    candidates = _candidates(ref)
    for options in ([{}] if padding is None else [{}, padding]):
        if options and q_len == k_len:
            structure = found("padding", {"length": k_len, **options} if "lengths" in options and
                              max(map(int, options["lengths"].split(","))) != k_len else options)
            if structure is not None:
                return structure
        for kind, kind_options in candidates:
            structure = found(kind, {**kind_options, **options})
            if structure is not None:
                return structure
    if key_padding and heads == 1 and batch == 1:
        rows = keep[0, 0]  # read [B, S]: each row is one batch item's key mask
        options = _padding_options(rows) if not bool(rows.all()) else {"lengths": ",".join([str(k_len)] * q_len)}
        structure = found("padding", options, "key padding [B, S]",
                          f"read as a key padding mask: {q_len} batch rows of {k_len} keys")
        if structure is None:  # compare each batch row with the built mask's rows
            try:
                spec = make_spec("padding", **options)
            except MaskError:
                spec = None
            if spec is not None and spec.k_len == k_len and torch.equal(build(spec).materialize()[:, 0, 0], rows):
                structure = Structure("padding", options, spec, command_for("padding", options), "key padding [B, S]",
                                      f"read as a key padding mask: {q_len} batch rows of {k_len} keys")
        if structure is not None:
            return structure
    if q_len > k_len:
        return Structure(None, note=f"more queries ({q_len}) than keys ({k_len}): no maskcli kind has that shape")
    return Structure(None, note="no maskcli kind rebuilds it exactly")


# --- findings --------------------------------------------------------------------------


def _where(b: int, h: int, shape) -> str:
    parts = [f"batch {b}"] if shape[0] > 1 else []
    if shape[1] > 1:
        parts.append(f"head {h}")
    return f" ({', '.join(parts)})" if parts else ""


def findings(tensor: torch.Tensor, convention: Convention, keep4: torch.Tensor, structure: Structure,
             heads: int | None = None, q_offset: int = 0) -> list[Finding]:
    """Rows that see nothing, later keys a kind does not mean, fills that overflow, a 3-D heads trap, and more."""
    result: list[Finding] = []
    q_len, k_len = keep4.shape[-2:]
    empty = fully_masked_rows(keep4)
    for b, h in torch.nonzero(empty.any(dim=-1)).tolist():
        if h > 0 and torch.equal(empty[b, h], empty[b, 0]):
            continue
        rows = [q_offset + i for i in torch.nonzero(empty[b, h]).flatten().tolist()]
        who = f"query row {rows[0]} sees" if len(rows) == 1 else f"query rows {spans(rows)} see"
        what = "batch row" if structure.reading == "key padding [B, S]" else None
        if what:
            who = f"batch row {b} has" if len(rows) == 1 else who
            result.append(Finding("fully-masked", f"batch row {b} hides every key: a length-0 sequence, NaN in SDPA's output"))
            continue
        consequence = "softmax over no key gives NaN" if convention.name in ("additive", "keep", "block") else "the weights there are uniform over masked keys"
        result.append(Finding("fully-masked", f"{who} no key at all{_where(b, h, keep4.shape)}: {consequence}"))
    if structure.kind is None and structure.reading == "mask":
        offset = k_len - q_len
        later = torch.triu(keep4, diagonal=offset + 1)
        any_later = later.any(dim=-1).any(dim=(0, 1))  # (Lq,)
        rows = any_later.nonzero().flatten().tolist()
        if rows:
            b, h = (int(x) for x in later.any(dim=(-1, -2)).nonzero()[0])
            keys = later[b, h, rows[0]].nonzero().flatten().tolist()
            example = f"query {q_offset + rows[0]} sees key{'s' if len(keys) > 1 else ''} {spans(keys)}"
            shown = [q_offset + r for r in rows]
            who = f"query row {shown[0]} sees" if len(rows) == 1 else f"query rows {spans(shown)} see"
            if len(rows) < q_len / 2:
                message = f"{who} later keys while the others do not: an off-by-one in a causal mask? ({example})"
            else:
                message = f"{who} later keys ({example}): a bidirectional mask, or one read the wrong way round?"
            result.append(Finding("sees-later", message))
        if q_len != k_len and q_len > 1 and torch.equal(keep4, torch.ones(q_len, k_len, dtype=torch.bool).tril().expand_as(keep4)):
            result.append(Finding(
                "top-left-causal",
                f"causal aligned top-left (query row q sees keys 0..q, torch.tril of a {q_len}x{k_len} matrix, "
                f"causal_upper_left, SDPA's is_causal=True): with {k_len - q_len} cached keys the new queries usually "
                f"sit at the end; bottom-right is maskcli show prefill --offset {k_len - q_len} --len {q_len}",
            ))
    if convention.name in ("min", "additive", "bias") and tensor.is_floating_point():
        finite = tensor[torch.isfinite(tensor)]
        lowest = float(finite.min()) if finite.numel() else 0.0
        for dtype in (torch.float16, torch.bfloat16):
            if tensor.dtype == dtype or lowest >= torch.finfo(dtype).min:
                continue
            cast = torch.tensor(lowest, dtype=torch.float64).to(dtype).item()
            if cast == float("-inf"):
                result.append(Finding(
                    "sentinel-overflow",
                    f"the fill value {lowest:.6g} does not fit {dtype_name(dtype)} (lowest {torch.finfo(dtype).min:.6g}): "
                    f"cast to {dtype_name(dtype)} it becomes -inf, so a fully masked row gives NaN "
                    f"(maskcli convert --to min --dtype {dtype_name(dtype)} writes finfo({dtype_name(dtype)}).min)",
                ))
    if convention.name == "int" and convention.ones_mean == "masked":
        result.append(Finding(
            "ones-masked",
            "1 marks the masked cells here: masked_fill(mask.bool(), -inf) applies it right, "
            "masked_fill(mask == 0, -inf) applies it backwards",
        ))
    if heads is not None:
        if tensor.dim() == 3 and tensor.shape[0] == heads and heads > 1:
            result.append(Finding(
                "3d-heads",
                f"the 3-D mask's first dimension is {heads}, the head count: SDPA applies it per head, but "
                f"nn.MultiheadAttention expects batch x heads there and gives each head the wrong mask once batch > 1 "
                f"(repeat it: mask.repeat(B, 1, 1) for a batch of B)",
            ))
        elif tensor.dim() == 3 and tensor.shape[0] not in (1, heads):
            result.append(Finding(
                "3d-shape",
                f"the 3-D mask's first dimension is {tensor.shape[0]}: SDPA needs 1 or the head count {heads} there; "
                f"nn.MultiheadAttention needs batch x heads = {heads} x B",
            ))
        elif tensor.dim() == 4 and tensor.shape[1] not in (1, heads):
            result.append(Finding(
                "heads-mismatch",
                f"the mask has {tensor.shape[1]} heads (dimension 1) but the model has {heads}: it broadcasts only when they are equal or it is 1",
            ))
    return result


# --- everything at once --------------------------------------------------------------


@dataclass(frozen=True)
class Analysis:
    tensor: torch.Tensor
    convention: Convention
    keep4: torch.Tensor  # bool (B, H, Lq, Lk) as shown: SDPA's view, or [B, 1, 1, S] for a key padding reading
    structure: Structure
    findings: list
    apis: list
    broadcast: str

    @property
    def q_offset(self) -> int:
        if self.structure.spec is not None and self.structure.reading == "mask":
            return self.structure.spec.offset
        return max(0, self.keep4.shape[-1] - self.keep4.shape[-2])

    def report(self, source: str) -> dict:
        """Everything said about the tensor, JSON-ready."""
        structure = self.structure
        return {
            "file": source,
            "dtype": dtype_name(self.tensor.dtype),
            "shape": list(self.tensor.shape),
            "broadcast": self.broadcast,
            "as_4d": list(sdpa_view(self.tensor).shape),
            "apis": self.apis,
            "convention": self.convention.name,
            "convention_sure": self.convention.sure,
            "convention_how": self.convention.how,
            "convention_note": self.convention.note,
            "sentinel": self.convention.sentinel,
            "ones_mean": self.convention.ones_mean if self.convention.name == "int" else None,
            "structure": structure.kind,
            "reading": structure.reading,
            "params": structure.params,
            "command": structure.command,
            "also": structure.also,
            "structure_note": structure.note,
            "findings": [{"code": f.code, "message": f.message} for f in self.findings],
        }


def analyse(tensor: torch.Tensor, heads: int | None = None, convention: Convention | None = None) -> Analysis:
    """Classify, recognise and find what is wrong, in one go; `convention` overrides the classification."""
    convention = convention or classify(tensor)
    keep = to_keep(tensor, convention)
    keep4 = sdpa_view(keep)
    structure = recognise(keep4, key_padding=tensor.dim() == 2) if keep4.numel() else Structure(None)
    if structure.reading == "key padding [B, S]":
        keep4 = keep[:, None, None, :]
    analysis = Analysis(tensor, convention, keep4, structure, [], api_fits(tensor, convention, structure.reading == "key padding [B, S]"),
                        broadcast_text(tensor))
    found = findings(tensor, convention, keep4, structure, heads, analysis.q_offset)
    return Analysis(**{**analysis.__dict__, "findings": found})
