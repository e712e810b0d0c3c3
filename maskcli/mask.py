"""Mask: an expression of kinds, on absolute positions, with its batch data; cells only on demand.

    from maskcli import build
    m = build("document(sizes=[3,5]) & window(2)")
    m.intervals()            # exact per-row key intervals (numpy)
    m.mask_mod               # FlexAttention mask_mod on local indices (torch)
    m.dense()                # bool (B, H, Lq, Lk) numpy, True = may attend

A dense tensor (from a file) is a Mask too, with `keep` set and no expression.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field, replace

import numpy as np

from maskcli import expression as ex
from maskcli import positions as pos
from maskcli import terms
from maskcli.errors import MaskError
from maskcli.intervals import Intervals, NotFew
from maskcli.kinds import get as get_kind
from maskcli.kinds.base import Labels
from maskcli.memory import check_dense_fits
from maskcli.positions import Frame
from maskcli.batchdata import longest, pad_side, padding, with_padding
from maskcli.batchdata import tokens as words
from maskcli.regions import bounds, checked_cells, checked_options, parse_region, region_intervals  # noqa: F401  (parse_region: for the commands)
from maskcli.text import shortened


@dataclass(frozen=True)
class MaskOptions:
    """What the command line says about a mask besides its expression; None = not given.

    From Python, lengths, ids, tokens and the labels in `params` may be lists, numpy arrays or tensors as well as
    the command line's text (maskcli.build takes the kind parameters by name: build("document", sizes=[3, 5]))."""

    length: int | None = None
    offset: int | None = None
    kv_start: int | None = None
    kv_len: int | None = None
    align: str | None = None
    heads: int = 1
    lengths: str | None = None
    ids: str | None = None
    pad_id: int = 0
    pad: str | None = None  # --pad: left or right, where --lengths puts the padding (default right)
    tokens: str | None = None
    params: dict = field(default_factory=dict)  # kind parameter flags: {"--window": 3, "--chunks": "0,0,1,1"}
    mask_file: str | None = None  # --mask: a tensor instead of an expression
    key: str | None = None  # --key: which tensor of the file
    from_: str | None = None  # --from: the tensor's convention, where its values do not say, or a kernel format
    causal: bool = False  # --causal: with --from flash-attn or flashmask, where the file does not say
    mask_mod: str | None = None  # --mask-mod FILE.py:NAME: the user's own predicate
    mask_mod_args: str | None = None  # --mask-mod-args: arguments for a mask_mod factory
    rows: str | None = None  # --rows A:B: the query positions to view (a region of the whole mask)
    keys: str | None = None  # --keys C:D: the key positions to view
    __post_init__ = checked_options  # whole numbers where positions are counted; rows / keys as (A, B) or 'A:B'


@dataclass(frozen=True, eq=False)
class Mask:
    """A mask: its name, positions, batch rows and heads, and where its cells come from."""

    text: str  # canonical expression text, or the file a tensor came from
    frame: Frame
    batch: int
    heads: int
    tree: object | None = None  # terms, with the key padding of --lengths/--ids and-ed on
    expression: object | None = None  # terms as the user wrote them (the name)
    tokens: tuple[str, ...] | None = None
    keep: np.ndarray | None = None  # a tensor's cells, bool (B, H, Lq, Lk)
    warnings: tuple[str, ...] = ()
    whole: Frame | None = None  # where `frame` is a region (--rows/--keys): the frame the kinds were built on
    made: tuple | None = None  # (frame, tree, their intervals) where its maker had them (a recognised candidate)

    def crop(self, rows: tuple[int | None, int | None] = (None, None), keys: tuple[int | None, int | None] = (None, None)) -> Mask:
        """A view of queries rows[0]..rows[1]-1 and keys keys[0]..keys[1]-1 (absolute positions; None: to the
        edge): the same mask, labels and padding kept from the whole, shown over a region."""
        f = self.frame
        (q_lo, q_hi), (k_lo, k_hi) = (bounds(rows, f.q_start, f.q_end, "--rows", "queries"),
                                      bounds(keys, f.k_start, f.k_end, "--keys", "keys"))
        view = replace(f, q_start=q_lo, q_len=q_hi - q_lo, k_start=k_lo, k_len=k_hi - k_lo)
        if self.keep is not None:
            keep = self.keep[:, :, q_lo - f.q_start : q_hi - f.q_start, k_lo - f.k_start : k_hi - f.k_start]
            return replace(self, frame=view, keep=keep)
        return replace(self, frame=view, whole=self.whole or f)

    @property
    def region_text(self) -> str:
        """'a region of queries 0-4095 · keys 0-4095' where the mask is viewed over a part of itself."""
        return f"a region of {self.whole.describe()}" if self.whole is not None else ""

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.batch, self.heads, self.frame.q_len, self.frame.k_len)

    @property
    def q_offset(self) -> int:
        return self.frame.q_start

    @property
    def kv_offset(self) -> int:
        return self.frame.k_start

    @property
    def kinds(self) -> list[str]:
        return [term.kind.name for term in terms.terms(self.expression)] if self.expression is not None else []

    @property
    def padding_text(self) -> str:
        """'lengths 4,2' or 'ids 5,6,0;7,0,0 (pad 0)': the key padding the flags added, in words."""
        f = self.frame
        if f.lengths is not None:
            return "lengths " + ",".join(map(str, f.lengths)) + (" (left-padded)" if f.pad_side == "left" else "")
        if f.ids is not None:
            return "ids " + ";".join(",".join(map(str, row)) for row in f.ids.tolist()) + f" (pad {f.pad_id})"
        return ""

    @property
    def title(self) -> str:
        """The name with the key padding, `causal · lengths 4,2`, shortened for headers (JSON has it whole)."""
        return (shortened(self.text) + (f" · {shortened(self.padding_text, 60)}" if self.padding_text else "")
                + (f" · {self.region_text}" if self.whole is not None else ""))

    @property
    def slug(self) -> str:
        """A file-name form of the name: causal_and_window_3."""
        words = self.text.replace("&", " and ").replace("|", " or ").replace("~", " not ")
        words = re.sub(r"(?<![\w)])-(?=\d)", " minus ", words)  # tril(-1) is not tril(1): tril_minus_1
        slug = "".join(c if c.isalnum() else "_" for c in words)
        slug = "_".join(part for part in slug.split("_") if part)[:80]
        return slug or "mask"

    @functools.cached_property
    def _intervals(self):
        if self.tree is None:
            return None, "a tensor's cells are read as they are"
        if self.made is not None and self.made[0] is self.frame and self.made[1] is self.tree and self.whole is None:
            return self.made[2], None  # (a Mask replaced with another frame or tree makes its own)
        # a few int64 arrays of (B, Lq, K) live at once while intervals combine; checked before labels from
        # sizes are made (kinds.base.Labels), so a 10^9-token document is refused here in O(1)
        sized = any(term.kind.sequence is not None for term in terms.terms(self.tree))
        check_dense_fits(
            (self.batch, self.frame.q_len), 8 * 2 * 6, "for its key intervals", what="a mask of",
            fix=f"use {'fewer positions in its labels' if sized else 'a smaller --len'}: maskcli keeps a few integers per query row",
        )
        try:
            if self.whole is None:
                return terms.intervals(self.tree, self.frame), None
            return region_intervals(terms.intervals(self.tree, self.whole), self.whole, self.frame), None
        except NotFew as reason:
            return None, str(reason)

    def intervals(self) -> Intervals:
        """Exact key intervals per (batch row, query row); raises NotFew where they are not few."""
        found, reason = self._intervals
        if found is None:
            raise NotFew(reason)
        return found

    @property
    def exact(self) -> bool:
        """True when the intervals are few: counts and maps come from them."""
        return self._intervals[0] is not None

    @property
    def heads_differ(self) -> bool:
        """True where heads may hold different masks (a file's own heads, a mask_mod that reads h): counts go
        head by head; else every head is head 0's."""
        if self.heads == 1:
            return False
        if self.keep is not None:
            return self.keep.shape[1] > 1
        return self.tree is not None and any(term.kind.per_head for term in terms.terms(self.tree))

    @property
    def why_not_exact(self) -> str | None:
        return self._intervals[1]

    @functools.cached_property
    def counted(self):
        """Where the intervals are not few but the mask is one kind that counts its keys itself (Kind.counts),
        with the flags' key padding: that kind's counts (keys_below(b, positions)); else None."""
        if self.tree is None or self.exact:
            return None
        tree = ex.simplified(self.tree)
        items = tree.items if isinstance(tree, ex.And) else (tree,)
        padding = [item for item in items if isinstance(item, terms.Term) and item.kind.name == "padding"]
        rest = [item for item in items if item not in padding]
        if len(rest) != 1 or not isinstance(rest[0], terms.Term) or rest[0].kind.counts is None:
            return None
        return rest[0].kind.counts(rest[0].values, self.frame, self.frame.key_valid if padding else None)

    @property
    def causal(self) -> bool:
        """No query sees a later key by construction (a causal kind and-ed in)."""
        return self.tree is not None and terms.is_causal(self.tree)

    def predicate(self, device="cpu"):
        """mask_mod(b, h, q, kv) on absolute positions (torch)."""
        if self.tree is None:
            raise ValueError("a tensor mask has no predicate of its own; use mask_mod")
        return terms.predicate(self.tree, self.whole or self.frame, device)

    def local_mask_mod(self, device="cpu"):
        """A FlexAttention mask_mod on local indices: it adds the query and key offsets itself."""
        if self.tree is None:
            import torch

            keep = torch.as_tensor(self.keep, device=device)

            def tensor_mask(b, h, q_idx, kv_idx):
                return keep[b if keep.shape[0] > 1 else 0, h if keep.shape[1] > 1 else 0, q_idx, kv_idx]

            return tensor_mask
        absolute = self.predicate(device)
        q0, k0 = self.frame.q_start, self.frame.k_start
        if q0 == 0 and k0 == 0:
            return absolute

        def offset_mask(b, h, q_idx, kv_idx):
            return absolute(b, h, q_idx + q0, kv_idx + k0)

        return offset_mask

    @property
    def mask_mod(self):
        """The local-index mask_mod on the CPU, for create_mask / create_block_mask."""
        return self.local_mask_mod("cpu")

    def cells(self, b: int, h: int = 0, q_lo: int = 0, q_hi: int | None = None) -> np.ndarray:
        """Bool (rows, Lk) numpy: query rows q_lo..q_hi-1 (local) of batch row b, head h."""
        q_hi = checked_cells(b, h, q_lo, q_hi, self.frame.q_len)  # (None: to the end; numpy read q_lo=-1 as the last row)
        if self.keep is not None:
            return self.keep[b if self.keep.shape[0] > 1 else 0, h if self.keep.shape[1] > 1 else 0, q_lo:q_hi]
        found, _ = self._intervals
        if found is not None:
            return found.dense(b, q_lo, q_hi)
        import torch

        keep = self.materialize(q_range=range(q_lo, q_hi), batch_rows=range(b, b + 1), heads=range(h, h + 1))
        return keep[0, 0].cpu().numpy() if isinstance(keep, torch.Tensor) else keep

    def dense(self) -> np.ndarray:
        """Bool (B, H, Lq, Lk) numpy, True = may attend (H is 1 where every head is the same)."""
        if self.keep is not None:
            return self.keep
        check_dense_fits((self.batch, 1, *self.shape[2:]), 1, "as a bool array")
        return np.stack([self.cells(b)[None] for b in range(self.batch)])

    def materialize(self, device="cpu", q_range: range | None = None, batch_rows: range | None = None, heads: range | None = None):
        """Bool torch tensor (B, H, Lq, Lk) from the predicate, one broadcast call (a view where it broadcasts);
        `q_range`, `batch_rows` and `heads` pick a part."""
        import torch

        device = torch.device(device)
        if device.type == "cuda" and device.index is None:  # cached index tensors must stay with the labels
            device = torch.device("cuda", torch.cuda.current_device())
        batch_rows = range(self.batch) if batch_rows is None else batch_rows
        q_range = range(self.frame.q_len) if q_range is None else q_range
        heads = range(self.heads) if heads is None else heads
        if self.keep is not None:
            keep = torch.as_tensor(self.keep, device=device)
            keep = keep[batch_rows.start : batch_rows.stop] if keep.shape[0] > 1 else keep
            keep = keep[:, heads.start : heads.stop] if keep.shape[1] > 1 else keep
            return torch.broadcast_to(keep[:, :, q_range.start : q_range.stop], (len(batch_rows), len(heads), len(q_range), self.frame.k_len))
        mod = _cached_predicate(self, device)
        f = self.frame
        b = pos.index_tensor(range(batch_rows.start, batch_rows.stop), 0, device)
        h = pos.index_tensor(heads, 1, device)
        q = pos.index_tensor(range(f.q_start + q_range.start, f.q_start + q_range.stop), 2, device)
        kv = pos.index_tensor(range(f.k_start, f.k_end), 3, device)
        keep = torch.as_tensor(mod(b, h, q, kv), device=device)
        return torch.broadcast_to(keep, (len(batch_rows), len(heads), len(q_range), f.k_len))

    def json(self) -> dict:
        """What names and places the mask, JSON-ready (no cells)."""
        kinds = [term.json() for term in terms.terms(self.expression)] if self.expression is not None else []
        single = kinds[0] if len(kinds) == 1 and not isinstance(self.expression, (ex.Not,)) else None
        data = {"expression": self.text, "kind": single["kind"] if single else None, "params": single["params"] if single else {},
                "kinds": kinds, "shape": list(self.shape), "q_offset": self.frame.q_start, "kv_offset": self.frame.k_start}
        f = self.frame
        if self.whole is not None:
            data["region"] = {"rows": [f.q_start, f.q_end], "keys": [f.k_start, f.k_end],
                              "of": {"rows": [self.whole.q_start, self.whole.q_end], "keys": [self.whole.k_start, self.whole.k_end]}}
        if f.lengths is not None:
            data["lengths"] = list(f.lengths)
            data["padding_side"] = f.pad_side
        if f.ids is not None:
            data["ids"] = f.ids.tolist()
            data["pad_id"] = f.pad_id
        if self.tokens is not None:
            data["tokens"] = list(self.tokens)
        return data


@functools.lru_cache(maxsize=8)
def _cached_predicate(mask: Mask, device):
    return mask.predicate(device)


# --- building one from what the user typed ---------------------------------------------------


def build(expression: str | None, options: MaskOptions | None = None, default_length: int | None = None, kinds=None, *,
          before=None, after=None, **flags) -> Mask:
    """The Mask an expression and options describe; keyword flags are MaskOptions fields. `kinds`: the user's own.

    `default_length`: the number of queries when neither --len nor the data says (inputs given to attend). `before`,
    `after`: terms a source bound itself (a batch's documents, a config's layer type), and-ed around the expression's
    (None: they alone) as one expression's are (terms.joined), with nothing written to be parsed.
    """
    options = options or MaskOptions(**flags)
    resolved, used = (terms.joined(before, after, source=None), []) if expression is None else \
        terms.resolve(ex.parse(expression, ex.MAX_TEXT), options.params, expression, kinds, before=before, after=after)
    terms.check_flags_used(resolved, options.params, used, expression)
    return placed(resolved, options, default_length)


def placed(resolved, options: MaskOptions, default_length: int | None = None) -> Mask:
    """build's end: terms already bound to their kinds, placed as the options say (recognition's candidates)."""
    frame, tokens = placing(resolved, options, default_length)
    return from_terms(resolved, frame, options.heads, tokens)


def placing(resolved, options: MaskOptions, default_length: int | None = None) -> tuple[Frame, tuple | None]:
    """placed's positions (and words) for the terms, with no Mask: the same positions make the same Mask."""
    lengths, ids = padding(options)
    by_lengths = longest(lengths)  # (batchdata asked once here, and once for the side below)
    tokens = words(options.tokens) if options.tokens is not None else None
    leaves = terms.terms(resolved)  # once: each reading below walks them
    sequence = _sequence(leaves, ids, tokens)
    queries = [term.kind.queries(term.values) for term in leaves if term.kind.queries]
    q_start, q_len, k_start, k_len = pos.resolve(
        length=options.length, offset=options.offset, kv_start=options.kv_start, kv_len=options.kv_len,
        align=options.align, sequence=sequence[0] if sequence else by_lengths, queries=queries[0] if queries else None,
        default=default_length or pos.DEFAULT_LEN,
    )
    frame, side = Frame(q_start, q_len, k_start, k_len), pad_side(options)
    frame = with_padding(frame, lengths, ids, options.pad_id, side) if lengths is not None or ids is not None else frame
    for what, count in sequence:
        pos.data_length(what, count, frame)
    return frame, tokens


def from_terms(resolved, frame: Frame, heads: int = 1, tokens=None, made: Intervals | None = None) -> Mask:
    """The Mask of terms bound to their kinds at `frame`'s positions: build's, and a source's that knows its kinds with no text to
    parse (serve's requests). The name is made from the terms, to be shown. `made`: their intervals at `frame` as the caller made them."""
    warnings: list[str] = []
    leaves, text = terms.terms(resolved), terms.text(resolved)
    for term in leaves:
        if term.kind.check is not None:
            warnings += term.kind.check(term.values, frame, shortened(term.text(), 60)) or []
    padded = frame.key_valid is not None  # (frame.padded)
    batch = _batch(leaves, frame, padded)
    if heads != 1:  # (1 always is)
        pos.check_size(heads, "--heads", "the number of attention heads")
    padding = terms.Term(get_kind("padding"), ()) if padded else None
    tree = ex.both(resolved, padding) if padded and resolved != padding else resolved  # padding cuts every mask
    made = None if padded or made is None else (frame, tree, made)  # (kept with what it was made of)
    return Mask(text, frame, batch, heads, tree, resolved, tokens, None, tuple(warnings), made=made)


def _sequence(leaves, ids, tokens) -> list[tuple[str, int]]:
    """What says how long the sequence is: (what, count) for labels (of the tree's terms), --ids and --tokens."""
    found = []
    for term in leaves:
        count = term.kind.sequence(term.values) if term.kind.sequence is not None else None
        if count is not None:  # a kind whose labels are optional (local's documents) may fix no length
            found.append((f"the labels of {term.text()[:60]}", count))
    if ids is not None:
        found.append(("--ids rows", ids.shape[1]))
    if tokens is not None:
        found.append((f"--tokens {shortened(' '.join(tokens), 60)!r}", len(tokens)))
    return found


def _batch(leaves, frame: Frame, padded: bool) -> int:
    """The batch size that the padding rows and the labels' rows (of the tree's terms) agree on (each 1 or the same B)."""
    sources = [("--lengths/--ids", frame.batch)] if padded else []
    for term in leaves:
        for name, value in term.params:
            if isinstance(value, Labels) and value.rows > 1:
                sources.append((term.text()[:60], value.rows))
    sizes = {size for _, size in sources if size > 1}
    if len(sizes) > 1:
        listed = ", ".join(f"{what} has {size}" for what, size in sources)
        raise MaskError(f"batch rows do not agree: {listed}; give each 1 row or the same number")
    return max(sizes, default=1)


def from_tensor(keep: np.ndarray, text: str, q_start: int = 0, k_start: int = 0, tokens=None) -> Mask:
    """A Mask over a dense bool (B, H, Lq, Lk) array, read from a file."""
    batch, heads, q_len, k_len = keep.shape
    return Mask(text, Frame(q_start, q_len, k_start, k_len), batch, heads, keep=keep, tokens=tokens)
