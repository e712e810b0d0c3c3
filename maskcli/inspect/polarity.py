"""A tensor's convention (keep, block, additive, min, int, or a bias), read from its values,
and a bool (or 0/1) tensor's polarity, read from its structure; on numpy arrays (a .pt file's tensor is
converted where it is loaded, check_maskable here).

A query normally sees its own position, so the cells (q, q + Lk - Lq) -- the diagonal,
bottom-right aligned -- tell keep from block; key padding shows as whole columns hidden,
and key 0 is rarely padding. Where one reading is a known kind and the other is not,
that decides it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import math

import numpy as np

from maskcli.conventions import FLOAT_MIN
from maskcli.errors import MaskError
from maskcli.inspect.structure import readings
from maskcli.tensorfile import as_array, dtype_name

SENTINEL_AT_MOST = -1e4  # a finite fill at most this negative masks (BERT's -10000.0 ... finfo.min)
STRUCTURE_CELLS = 1 << 24  # above this many cells, polarity is told from the diagonal alone
MASK_DTYPES = ("bool", "uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32", "float64")
WIDE_UNSIGNED = ("uint16", "uint32", "uint64")  # masks only where they hold 0 and 1


def check_maskable(values, where: str) -> np.ndarray:
    """The values as a numpy array of a mask dtype, or a one-line MaskError saying why they cannot be a mask.

    numpy arrays come from every file but .pt; a torch tensor (a .pt file's) is checked for what only torch
    has (quantized, meta, sparse) and converted here, its edge. bfloat16 comes back widened (tensorfile.BFLOAT16).
    """
    name = dtype_name(values)
    if name.startswith("complex"):
        raise MaskError(f"{where} holds complex numbers ({name}), which cannot be a mask")
    torch_in = not isinstance(values, np.ndarray)
    if torch_in and values.is_quantized:
        raise MaskError(f"{where} is a quantized tensor ({name}); a mask is bool, 0/1 or float")
    if torch_in and values.device.type == "meta":
        raise MaskError(f"{where} is a meta tensor: it has a shape but no values")
    shape = list(values.shape)
    if len(shape) > 4:
        raise MaskError(f"{where} has {len(shape)} dimensions {shape}: a mask has at most 4 (B, H, Lq, Lk)")
    if not shape:
        raise MaskError(f"{where} is a single number ({values.item()}), not a mask: a mask has shape (Lq, Lk) up to (B, H, Lq, Lk)")
    if math.prod(shape) == 0:
        raise MaskError(f"{where} is empty (shape {shape})")
    if torch_in and str(values.layout) != "torch.strided":
        from maskcli.memory import check_dense_fits  # a sparse file's few values can stand for cells past any memory

        check_dense_fits(tuple(shape), values.element_size() + 1, f"to make {where} ({values.layout}) dense",
                         fix="save the mask at a size whose cells fit, or as a maskcli expression or intervals")
        try:
            values = values.to_dense()
        except Exception as error:  # some layouts have no dense form for some dtypes
            raise MaskError(f"{where} is a {values.layout} tensor that cannot be made dense ({str(error).splitlines()[0][:120]})") from None
    if name not in MASK_DTYPES + WIDE_UNSIGNED:
        raise MaskError(
            f"{where} has dtype {name}, which cannot be a mask here: "
            "use bool, an integer type or float16/bfloat16/float32/float64"
        )
    values = as_array(values)
    if name in WIDE_UNSIGNED:
        if int(values.max()) > 1:  # only 0/1 matter; larger values are refused by classify anyway
            raise MaskError(f"{where} ({name}) holds values above 1; a mask is bool, 0/1 or float")
        values = values.astype(np.int64)
    return values


def sdpa_view(values: np.ndarray) -> np.ndarray:
    """The (B, H, Lq, Lk) view that SDPA's broadcasting gives: leading dimensions of size 1 are added."""
    return values.reshape((1,) * (4 - values.ndim) + tuple(values.shape))

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
    # where the structure told it: the Structure that rebuilds the tensor read so (inspect names it with no second
    # recognition)
    structure: object | None = field(default=None, compare=False, repr=False)

    @property
    def sure(self) -> bool:
        return self.how in ("values", "structure")


def _sentinel_name(value: float, dtype: str) -> str:
    for candidate in (dtype, "float32", "float16", "bfloat16", "float64"):
        if value == FLOAT_MIN.get(candidate):
            return f"finfo({candidate}).min"
    return f"{value:g}"


def classify(tensor: np.ndarray, where: str = "the mask") -> Convention:
    """The tensor's convention from its dtype and values; a bool or 0/1 tensor's polarity from its structure.
    `where` names the tensor in a refusal (its file, as the user gave it)."""
    if tensor.dtype == bool:
        meaning, how, why, structure = _polarity(tensor)
        if meaning is None:
            return Convention("keep", how, why)
        name = "keep" if meaning == "attend" else "block"
        return Convention(name, how, f"read as {name} (True = {'may attend' if name == 'keep' else 'masked'}): {why}",
                          structure=structure)
    if tensor.dtype.kind != "f":
        zero_one = (tensor == 0) | (tensor == 1)
        if not bool(zero_one.all()):
            values = np.unique(tensor[~zero_one])  # only the offending values: small, and this is an error path
            shown = ", ".join(map(str, values[:6].tolist())) + (", ..." if len(values) > 6 else "")
            raise MaskError(
                f"{where} holds integer values {{{shown}}}, not a 0/1 mask (masks are bool, 0/1 or float); "
                "chunk or document labels go to maskcli show chunk/document --chunks"
            )
        return _zero_one(tensor, "integer")
    # Everything below is a few passes over the values: no sort (np.unique) of a large mask.
    nan = np.isnan(tensor)
    if bool(nan.any()):
        raise MaskError(
            f"{where} holds NaN in {int(nan.sum())} cells; a float mask is 0 where attending "
            "and -inf or a large negative number where masked"
        )
    if bool((tensor == math.inf).any()):
        raise MaskError(f"{where} holds +inf, which makes softmax NaN; a float mask is 0 where attending and -inf or a large negative number where masked")
    masked = tensor[tensor != 0].astype(np.float64)
    if len(masked) == 0:
        return Convention("additive", "values", "every value is 0: an additive mask that masks nothing (read as 0/1, everything would be masked)")
    if bool((masked == 1).all()):
        return _zero_one(tensor, "float")
    if bool((masked <= SENTINEL_AT_MOST).all()):
        finite = masked[np.isfinite(masked)]
        if len(finite) == 0:
            return Convention("additive", "values", "float 0 / -inf, added to the scores")
        if len(finite) == len(masked) and bool((finite == finite[0]).all()):
            sentinel = float(finite[0])
            return Convention(
                "min", "values",
                f"float 0 / {_sentinel_name(sentinel, dtype_name(tensor))}, added to the scores (Hugging Face eager style)", sentinel,
            )
        fills = ", ".join(f"{v:g}" for v in np.unique(masked)[:4].tolist())
        return Convention(
            "additive", "values", f"float 0 and several fills ({fills}): all mask, since each is -inf or at most {SENTINEL_AT_MOST:g}",
            float(finite.min()),
        )
    finite = masked[np.isfinite(masked)]
    lo, hi = float(finite.min()), float(max(finite.max(), 0))
    return Convention(
        "bias", "values",
        f"float values from {lo:g} to {hi:g}, not just 0 and one fill: an additive bias (ALiBi, relative positions), "
        f"not a mask; its masked cells are those at -inf or at most {SENTINEL_AT_MOST:g}",
        lo if lo <= SENTINEL_AT_MOST else None,
    )


def _zero_one(tensor: np.ndarray, what: str) -> Convention:
    """0/1 numbers: 1 = attend (torch.tril(torch.ones(L, L))) unless the structure says 1 = masked (triu(ones, 1))."""
    if bool((tensor == 0).any()) and bool((tensor == 1).any()):
        meaning, how, why, structure = _polarity(tensor != 0)
        if meaning == "masked" and how == "structure":
            return Convention(
                "int", "structure",
                f"{what} 0/1 with 1 = masked, a torch.triu(torch.ones(L, L), 1) mask: {why}", ones_mean="masked",
                structure=structure,
            )
    return Convention("int", "values", f"{what} 0/1, 1 = attend (torch.tril(torch.ones(L, L)) style)")


def _polarity(ones: np.ndarray) -> tuple[str | None, str, str, object | None]:
    """Whether True (or 1) means attend or masked here, how that was told, why, and the Structure that told it
    (None where the structure did not)."""
    x = sdpa_view(ones)
    if bool(x.all()) or not bool(x.any()):
        value = bool(x.flatten()[0])
        return None, "cannot tell", (
            f"every cell is {value}: read as keep {'nothing' if value else 'everything'} is masked, "
            f"read as block {'everything' if value else 'nothing'}"
        ), None
    q_len, k_len = x.shape[-2:]
    if x.size <= STRUCTURE_CELLS:
        # Each reading scores 2 for a maskcli kind, 1 for a raw tril/triu, 0 for none, and 1 less
        # when some query would see no key. A clear winner decides.
        scored = [((0 if structure.kind is None else 1 if structure.kind in ("tril", "triu") else 2) - empty, meaning, structure, empty)
                  for meaning, structure, empty in readings(x, key_padding=ones.ndim == 2)]
        (top, best, structure, _), (other, _, flipped, flipped_empty) = sorted(scored, key=lambda r: -r[0])
        if top >= 2 > other or (top >= 1 and other < 0 and structure.kind is not None):
            instead = "no maskcli kind rebuilds it" if flipped.kind is None else (
                f"it would be {flipped.expression}" + (" with queries that see no key" if flipped_empty else "")
            )
            return best, "structure", f"maskcli's {structure.expression} rebuilds it read this way; read the other way round, {instead}", structure
    # The diagonal cells (q, q + Lk - Lq), leaving out columns that are the same for every query (padding-like).
    # Where Lq != Lk the top-left diagonal (q, q) is asked too: if the two disagree, the alignment is in
    # question (causal_upper_left against lower_right), not the polarity, and key 0 decides.
    constant = x.all(axis=-2) | ~x.any(axis=-2)  # (B, H, Lk)
    shares = []
    for offset in dict.fromkeys((k_len - q_len, 0)):
        diagonal = np.diagonal(x, offset=offset, axis1=-2, axis2=-1)
        columns = np.arange(diagonal.shape[-1]) + max(offset, 0)
        informative = diagonal[~constant[..., columns]]
        shares.append(float(informative.mean()) if informative.size else 0.5)
    share = shares[0]
    if share != 0.5 and all((other > 0.5) == (share > 0.5) and other != 0.5 for other in shares[1:]):
        meaning = "attend" if share > 0.5 else "masked"
        seen = share if meaning == "attend" else 1 - share
        return meaning, "structure" if seen >= 0.9 else "guess", (
            f"{seen:.0%} of the queries see their own position (cell q, q + Lk - Lq) read this way, as queries normally do"
        ), None
    first = float(x[..., 0].mean())
    if first != 0.5:
        meaning = "attend" if first > 0.5 else "masked"
        return meaning, "guess", "the diagonal does not tell; key 0 is visible read this way, and key 0 is rarely padding", None
    return None, "cannot tell", "neither the diagonal nor key 0 tells which way round it is; read as keep", None


def marks(convention: Convention) -> str:
    """What the cells a tensor marks (True, 1, nonzero) mean in `convention`: "attend" or "masked"."""
    if convention.name == "keep" or (convention.name == "int" and convention.ones_mean == "attend"):
        return "attend"
    return "masked"


def to_keep(tensor: np.ndarray, convention: Convention | str) -> np.ndarray:
    """The bool keep mask (True = may attend) that `tensor` means in `convention`.

    As a name, "keep" and "block" also apply to 0/1 numbers (nonzero = attend, nonzero = masked).
    """
    if isinstance(convention, str):
        convention = Convention(convention, "values", "")
    name = convention.name
    if name == "keep" or (name == "int" and convention.ones_mean == "attend"):
        return tensor if tensor.dtype == bool else tensor != 0
    if name == "block" or name == "int":
        return ~tensor if tensor.dtype == bool else tensor == 0
    if name in ("additive", "min", "bias"):
        return additive_keep(tensor)
    raise ValueError(f"unknown convention {name!r}")


def additive_keep(scores_mask):
    """Where a float mask added to the scores lets a query attend: finite and above SENTINEL_AT_MOST.

    Comparisons only, so it reads numpy arrays and torch tensors alike (trace's captured masks, on their device);
    NaN fails both and is masked, as isfinite would have it.
    """
    return (scores_mask > SENTINEL_AT_MOST) & (scores_mask < math.inf)


