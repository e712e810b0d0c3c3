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
from dataclasses import dataclass, field, replace

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
        return f"[Lq={shape[0]}, Lk={shape[1]}] broadcasts over batch and heads to (1, 1, {shape[0]}, {shape[1]})" + (
            f"; as a key padding mask it is [B={shape[0]}, S={shape[1]}]" if shape[0] != shape[1] else ""
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
    if not tensor.is_floating_point():
        zero_one = (tensor == 0) | (tensor == 1)
        if not bool(zero_one.all()):
            values = torch.unique(tensor[~zero_one])  # only the offending values: small, and this is an error path
            shown = ", ".join(map(str, values[:6].tolist())) + (", ..." if len(values) > 6 else "")
            raise MaskError(
                f"integer values {{{shown}}} are not a 0/1 mask (masks are bool, 0/1 or float); "
                "chunk or document labels go to maskcli show chunk/document --chunks"
            )
        return _zero_one(tensor, "integer")
    # Everything below is a few passes over the values: no sort (torch.unique) of a large mask.
    nan = torch.isnan(tensor)
    if bool(nan.any()):
        raise MaskError(
            f"the mask holds NaN in {int(nan.sum())} cells; a float mask is 0 where attending "
            "and -inf or a large negative number where masked"
        )
    if bool((tensor == float("inf")).any()):
        raise MaskError("the mask holds +inf, which makes softmax NaN; a float mask is 0 where attending and -inf or a large negative number where masked")
    masked = tensor[tensor != 0].to(torch.float64)
    if len(masked) == 0:
        return Convention("additive", "values", "every value is 0: an additive mask that masks nothing (read as 0/1, everything would be masked)")
    if bool((masked == 1).all()):
        return _zero_one(tensor, "float")
    if bool((masked <= SENTINEL_AT_MOST).all()):
        finite = masked[torch.isfinite(masked)]
        if len(finite) == 0:
            return Convention("additive", "values", "float 0 / -inf, added to the scores")
        if len(finite) == len(masked) and bool((finite == finite[0]).all()):
            sentinel = float(finite[0])
            return Convention(
                "min", "values",
                f"float 0 / {_sentinel_name(sentinel, tensor.dtype)}, added to the scores (Hugging Face eager style)", sentinel,
            )
        fills = ", ".join(f"{v:g}" for v in torch.unique(masked)[:4].tolist())
        return Convention(
            "additive", "values", f"float 0 and several fills ({fills}): all mask, since each is -inf or at most {SENTINEL_AT_MOST:g}",
            float(finite.min()),
        )
    finite = masked[torch.isfinite(masked)]
    lo, hi = float(finite.min()), float(max(finite.max(), 0))
    return Convention(
        "bias", "values",
        f"float values from {lo:g} to {hi:g}, not just 0 and one fill: an additive bias (ALiBi, relative positions), "
        f"not a mask; its masked cells are those at -inf or at most {SENTINEL_AT_MOST:g}",
        lo if lo <= SENTINEL_AT_MOST else None,
    )


def _zero_one(tensor: torch.Tensor, what: str) -> Convention:
    """0/1 numbers: 1 = attend (torch.tril(torch.ones(L, L))) unless the structure says 1 = masked (triu(ones, 1))."""
    if bool((tensor == 0).any()) and bool((tensor == 1).any()):
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
        # Each reading scores 2 for a maskcli kind, 1 for a raw tril/triu, 0 for none, and 1 less
        # when some query would see no key. A clear winner decides.
        readings = []
        for meaning, keep in (("attend", x), ("masked", ~x)):
            structure = recognise(keep, key_padding=ones.dim() == 2, marked=meaning)
            empty = bool(fully_masked_rows(keep).any())
            score = (0 if structure.kind is None else 1 if structure.kind in ("tril", "triu") else 2) - empty
            readings.append((score, meaning, structure, empty))
        (top, best, structure, _), (other, _, flipped, flipped_empty) = sorted(readings, key=lambda r: -r[0])
        if top >= 2 > other or (top >= 1 and other < 0 and structure.kind is not None):
            instead = "no maskcli kind rebuilds it" if flipped.kind is None else (
                f"it would be {flipped.kind}" + (" with queries that see no key" if flipped_empty else "")
            )
            return best, "structure", f"maskcli's {structure.kind} rebuilds it read this way; read the other way round, {instead}"
    # The diagonal cells (q, q + Lk - Lq), leaving out columns that are the same for every query (padding-like).
    # Where Lq != Lk the top-left diagonal (q, q) is asked too: if the two disagree, the alignment is in
    # question (causal_upper_left against lower_right), not the polarity, and key 0 decides.
    constant = x.all(dim=-2) | ~x.any(dim=-2)  # (B, H, Lk)
    shares = []
    for offset in dict.fromkeys((k_len - q_len, 0)):
        diagonal = torch.diagonal(x, offset=offset, dim1=-2, dim2=-1)
        columns = torch.arange(diagonal.shape[-1]) + max(offset, 0)
        informative = diagonal[~constant[..., columns]]
        shares.append(informative.float().mean().item() if informative.numel() else 0.5)
    share = shares[0]
    if share != 0.5 and all((other > 0.5) == (share > 0.5) and other != 0.5 for other in shares[1:]):
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


def marks(convention: Convention) -> str:
    """What the cells a tensor marks (True, 1, nonzero) mean in `convention`: "attend" or "masked"."""
    if convention.name == "keep" or (convention.name == "int" and convention.ones_mean == "attend"):
        return "attend"
    return "masked"


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


def _as_bool(expr: str, tensor: torch.Tensor, convention: Convention, want: str) -> str:
    """Python for `expr` as a bool mask where True means `want` ("attend" or "masked")."""
    if marks(convention) == want:
        return expr if tensor.dtype == torch.bool else f"{expr}.bool()"
    return f"~{expr}" if tensor.dtype == torch.bool else f"({expr} == 0)"


def api_fits(tensor: torch.Tensor, convention: Convention, key_padding: bool = False) -> list[str]:
    """For SDPA attn_mask, nn.MultiheadAttention attn_mask and key_padding_mask: yes as is, or the expression to pass instead."""
    name, dims, shape = convention.name, tensor.dim(), tensor.shape
    floats = name in ("additive", "min", "bias")
    fits = []

    sdpa = "F.scaled_dot_product_attention attn_mask: "
    heads_note = ", its first dimension read as heads" if dims == 3 else ""
    if key_padding:
        keep_form = "mask" if floats else _as_bool("mask", tensor, convention, "attend")
        sdpa += f"no, SDPA reads 2-D as (Lq, Lk), not [B, S]; pass {keep_form}[:, None, None, :]"
    elif name == "keep":
        sdpa += f"yes, as is (True = attend){heads_note}"
    elif floats:
        sdpa += f"yes, as is (added to the scores; in the query's dtype){heads_note}"
    elif name == "block":
        sdpa += "no, SDPA reads True as attend; pass ~mask"
    elif tensor.is_floating_point():
        sdpa += f"no, a float mask is added to the scores, so 0/1 masks nothing; pass {_as_bool('mask', tensor, convention, 'attend')}"
    else:
        sdpa += f"no, it takes bool or float; pass {_as_bool('mask', tensor, convention, 'attend')}"
    fits.append(sdpa)

    mha = "nn.MultiheadAttention attn_mask: "
    if key_padding:
        mha += "no, a [B, S] padding mask goes to key_padding_mask"
    elif dims == 1:
        mha += "no, it takes 2-D (L, S) or 3-D (B*num_heads, L, S); a 1-D key row goes to key_padding_mask"
    else:
        shaped = "mask"
        if dims == 4:
            shaped = "mask[0, 0]" if shape[0] == 1 and shape[1] == 1 else "mask.expand(-1, num_heads, -1, -1).flatten(0, 1)"
        if dims in (2, 3) and (name == "block" or floats):
            mha += "yes, as is" + (" (True = masked)" if name == "block" else " (added to the scores)")
        else:
            reason = "it takes 2-D (L, S) or 3-D (B*num_heads, L, S)" if dims == 4 else "MHA reads True as masked" if name == "keep" else "it takes a bool block or float mask"
            fixed = shaped if floats or name == "block" else _as_bool(shaped, tensor, convention, "masked")
            mha += f"no, {reason}; pass {fixed}"
    fits.append(mha)

    kpm = "nn.MultiheadAttention key_padding_mask: "
    row_shaped = (dims == 2 and (key_padding or shape[0] != shape[1])) or dims == 1 or (dims == 4 and shape[1] == 1 and shape[2] == 1)
    if row_shaped:
        shaped = {1: "mask.expand(B, -1)", 2: "mask", 4: "mask[:, 0, 0]"}[dims]
        ok = name == "block" or name in ("additive", "min")
        if dims == 2 and ok:
            kpm += "yes, as is" if key_padding else f"yes, if its rows are batch items ([B={shape[0]}, S={shape[1]}])"
        else:
            fixed = shaped if ok else _as_bool(shaped, tensor, convention, "masked")
            kpm += f"no, it takes [B, S] with True = padding; pass {fixed}"
        fits.append(kpm)
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


def _padding_kind(padding: dict, k_len: int) -> dict:
    """Options for the padding kind itself: --len where the longest length is shorter than the keys."""
    if "lengths" in padding and max(map(int, padding["lengths"].split(","))) != k_len:
        return {"length": k_len, **padding}
    return padding


def _candidates(ref: torch.Tensor, marked: str = "attend") -> list[tuple[str, dict]]:
    """Kinds and parameters read off one (Lq, Lk) keep matrix, simplest first; each is then checked by rebuilding.

    torch.tril(ones, d) read as keep is torch.triu(ones, d + 1) read as block: `marked` says
    which cells the file marks (True/1/nonzero: "attend" or "masked"), and the tril/triu
    named is the one whose 1-cells are those.
    """
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
        if bool(lower.any()):  # keep = tril(d)
            row = int(lower.nonzero()[0])
            d = int(last[row]) - row
            candidates.append(("tril", {"length": q_len, "diagonal": d}) if marked == "attend"
                              else ("triu", {"length": q_len, "diagonal": d + 1}))
        upper = (first > 0) & rows
        if bool(upper.any()):  # keep = triu(d)
            row = int(upper.nonzero()[0])
            d = int(first[row]) - row
            candidates.append(("triu", {"length": q_len, "diagonal": d, "means": "keep"}) if marked == "attend"
                              else ("tril", {"length": q_len, "diagonal": d - 1, "means": "block"}))
    return candidates


def recognise(keep4: torch.Tensor, key_padding: bool = False, marked: str = "attend") -> Structure:
    """The maskcli kind (and options) whose mask is exactly this keep mask (B, H, Lq, Lk), or kind None.

    `key_padding`: the tensor was 2-D, so it may also be a [B, S] key padding mask; that
    reading is used when the (Lq, Lk) reading matches no kind and the tensor is not square.
    `marked`: what the file's True/1/nonzero cells mean, "attend" or "masked" (picks tril or triu).
    """
    batch, heads, q_len, k_len = keep4.shape
    if heads > 1 and not bool((keep4 == keep4[:, :1]).all()):
        per_head = []
        for h in range(min(heads, 8)):
            found = recognise(keep4[:, h : h + 1], marked=marked)
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
            row = found("padding", _padding_kind(padding, k_len), "key padding row",
                        "the query dimension is 1, so this one row of keys applies to every query")
            if row is not None:
                return replace(row, also=decode.command if decode else None)
        if decode is not None:
            return replace(decode, note="a single decode step: the one query sees every key up to its own position")
    if bool(keep.all()) and q_len == k_len:
        full = found("padding", {"lengths": ",".join([str(k_len)] * batch)}, note="every query sees every key: nothing is masked")
        if full is not None:
            return full
    candidates = _candidates(ref, marked)
    for options in ([{}] if padding is None else [{}, padding]):
        if options and q_len == k_len:
            structure = found("padding", _padding_kind(options, k_len))
            if structure is not None:
                return structure
        for kind, kind_options in candidates:
            structure = found(kind, {**kind_options, **options})
            if structure is not None:
                return structure
    if key_padding and heads == 1 and batch == 1 and q_len != k_len:  # a square one is (L, L): B == S would be a coincidence
        rows = keep[0, 0]  # read as [B, S]: each row is one batch item's keys
        options = _padding_kind(_padding_options(rows), k_len)
        spec = make_spec("padding", **options)
        if spec.k_len == k_len and torch.equal(build(spec).materialize()[:, 0, 0], rows):
            return Structure("padding", options, spec, command_for("padding", options), "key padding [B, S]",
                             f"read as a key padding mask: {q_len} batch rows of {k_len} keys")
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
    empty = fully_masked_rows(keep4)  # (B, H, Lq)
    if structure.reading == "key padding [B, S]":
        batch_rows = empty[:, 0, 0].nonzero().flatten().tolist()
        if batch_rows:
            who = f"batch row {batch_rows[0]} hides" if len(batch_rows) == 1 else f"batch rows {spans(batch_rows)} hide"
            result.append(Finding("fully-masked", f"{who} every key: a length-0 sequence, whose queries see no key at all"))
    else:
        for b, h in torch.nonzero(empty.any(dim=-1)).tolist():
            if h > 0 and torch.equal(empty[b, h], empty[b, 0]):
                continue  # the same rows as head 0: said once
            rows = [q_offset + i for i in torch.nonzero(empty[b, h]).flatten().tolist()]
            who = f"query row {rows[0]} sees" if len(rows) == 1 else f"query rows {spans(rows)} see"
            result.append(Finding(
                "fully-masked",
                f"{who} no key at all{_where(b, h, keep4.shape)}: softmax over nothing, NaN with an -inf fill and "
                "uniform weights over the masked keys with a finite one (maskcli verify shows what each backend does)",
            ))
    # later keys are worth a word unless a kind that means them rebuilds the mask (tril/triu mean them only by accident)
    if structure.reading == "mask" and structure.kind in (None, "tril", "triu"):
        offset = k_len - q_len
        later = torch.triu(keep4, diagonal=offset + 1)
        any_later = later.any(dim=-1).any(dim=(0, 1))  # (Lq,)
        rows = any_later.nonzero().flatten().tolist()
        if rows:
            b, h = (int(x) for x in later[..., rows[0], :].any(dim=-1).nonzero()[0])
            keys = later[b, h, rows[0]].nonzero().flatten().tolist()
            where = _where(b, h, keep4.shape).strip(" ()")
            example = f"query {q_offset + rows[0]} sees key{'s' if len(keys) > 1 else ''} {spans(keys)}" + (f" in {where}" if where else "")
            shown = [q_offset + r for r in rows]
            who = f"query row {shown[0]} sees" if len(rows) == 1 else f"query rows {spans(shown)} see"
            if structure.kind is not None:
                message = (
                    f"{who} later keys ({example}): {structure.kind} --diagonal {structure.params.get('diagonal')} "
                    "reaches past the diagonal, which a causal mask does not (an off-by-one?)"
                )
            elif len(rows) < q_len / 2:
                message = f"{who} later keys while the others do not: an off-by-one in a causal mask? ({example})"
            else:
                message = f"{who} later keys ({example}): a bidirectional mask, or one read the wrong way round?"
            result.append(Finding("sees-later", message))
    q_len, k_len = sdpa_view(tensor).shape[-2:]
    if structure.kind is None or structure.reading == "key padding [B, S]":
        as_matrix = sdpa_view(to_keep(tensor, convention))  # (Lq, Lk) as SDPA reads it, whatever the reading above
        if 1 < q_len < k_len and torch.equal(as_matrix, torch.ones(q_len, k_len, dtype=torch.bool).tril().expand_as(as_matrix)):
            result.append(Finding(
                "top-left-causal",
                ("read as an (Lq, Lk) mask instead, it is " if structure.kind is not None else "")
                + f"causal aligned top-left (query row q sees keys 0..q, torch.tril of a {q_len}x{k_len} matrix, "
                f"causal_upper_left, SDPA's is_causal=True): with {k_len - q_len} cached keys the new queries usually "
                f"sit at the end; bottom-right is maskcli show prefill --offset {k_len - q_len} --len {q_len}",
            ))
    if convention.sentinel is not None:  # the lowest finite fill (-inf needs no check: it is -inf in every dtype)
        lowest = convention.sentinel
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
        """The absolute position of query row 0: the kind's own, else bottom-right alignment (maskcli's reading)."""
        if self.structure.reading != "mask":
            return 0
        if self.structure.spec is not None:
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
    structure = recognise(keep4, key_padding=tensor.dim() == 2, marked=marks(convention))
    key_padding = structure.reading == "key padding [B, S]"
    if key_padding:
        keep4 = keep[:, None, None, :]
    analysis = Analysis(tensor, convention, keep4, structure, [], api_fits(tensor, convention, key_padding), broadcast_text(tensor))
    return replace(analysis, findings=findings(tensor, convention, keep4, structure, heads, analysis.q_offset))
