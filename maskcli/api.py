"""The Python face of maskcli: build() from Python values, and masks, diffs and block views that show themselves.

    from maskcli import build
    m = build("document", sizes=[300, 212]) & ...      # kind parameters by name, as the command line's flags
    m = build("causal", lengths=[5, 3])                # lists, numpy arrays or tensors for lengths, ids, labels
    m                                                  # Mask('causal', shape=(2, 1, 5, 5), padding='lengths 5,3')
    m.table(); m.figure(); m.summary(); m.why(4, 2); m.diff(other); m.blocks(64)

In Jupyter each displays itself as the terminal shows it (a table with structure marks when small, the exact density
map when large, under the same header), through `_repr_html_`. The core (maskcli.mask) knows nothing of rich or
matplotlib: this module sits above the renderers and imports them only when a view is asked for.
"""

from __future__ import annotations

from dataclasses import fields, replace

from maskcli import blockmask, diff as diffs, mask as core, summary as summaries
from maskcli.text import shortened

WIDTH = 120  # columns of a table or map shown in a notebook, and of table() where no terminal says its width


def build(expression: str | None = None, options: core.MaskOptions | None = None, **given) -> Mask:
    """The mask an expression describes, with MaskOptions fields and kind parameters as keywords.

    Keywords are MaskOptions fields (length, offset, kv_start, kv_len, align, heads, lengths, ids, pad_id, pad, tokens,
    mask_file, key, from_, mask_mod, mask_mod_args, rows, keys) or the parameters of a bare kind named as their
    command-line flags are (window=3, sizes=[3, 5], chunks=labels, block_ids=ids, parents=[-1, 0, 0], chunk_size=4,
    documents=labels, diagonal=-1, means="block", prefix=3, sink=4). Lengths, ids, tokens and labels take lists,
    numpy arrays or tensors (on any device) as well as the command line's text.
    """
    from maskcli.sources import registry
    from maskcli.kinds import flags

    names = {f.name for f in fields(core.MaskOptions)}
    known = {flag.lstrip("-").replace("-", "_"): flag for flag in flags()}
    unknown = sorted(set(given) - names - set(known))
    if unknown:
        raise TypeError(f"build() got an unexpected keyword {unknown[0]!r}: give a MaskOptions field "
                        f"({', '.join(sorted(names - {'params'}))}) or a kind parameter ({', '.join(sorted(known))})")
    chosen = {name: _whole(name, value) if name in WHOLE else value for name, value in given.items() if name in names}
    params = {known[name]: value for name, value in given.items() if name in known and value is not None}
    options = core.MaskOptions(**chosen) if options is None else replace(options, **chosen)
    if params:
        options = replace(options, params={**options.params, **params})
    return shown(registry.load(expression, options))


WHOLE = ("length", "offset", "kv_start", "kv_len", "heads", "pad_id")  # MaskOptions fields that count positions


def _whole(name: str, value):
    """An int (a numpy integer too) or None, else a MaskError: a float, NaN, Decimal or bool here would make a mask of
    fractional positions (offset=1.5 made keys 0-4.5), not a refusal."""
    import operator

    if value is None or (name == "heads" and value == 1 and type(value) is int):
        return value
    try:
        if isinstance(value, bool) or isinstance(value, str):
            raise TypeError
        return operator.index(value)  # ints and numpy integers; floats and Decimals have no __index__
    except TypeError:
        from maskcli.errors import MaskError

        raise MaskError(f"build(): {name}={value!r} is a {type(value).__name__}; {name} is a whole number (an int)") from None


def shown(mask: core.Mask) -> Mask:
    """The same mask, with the views of this module (no copy of its arrays)."""
    return mask if isinstance(mask, Mask) else Mask(**{f.name: getattr(mask, f.name) for f in fields(mask)})


def _html(views) -> str:
    """What a terminal would print, as an HTML fragment with its colours inline (rich's export)."""
    import io

    from rich.console import Console

    console = Console(record=True, width=WIDTH, file=io.StringIO(), color_system="truecolor")
    for view in views:
        console.print(view)
    return console.export_html(inline_styles=True, code_format="<pre style=\"font-family:monospace;line-height:1.2\">{code}</pre>")


def _counts(value) -> bool:
    """An int or a numpy integer: not a bool, a float, a Decimal or a string."""
    import numbers

    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _width(width: int | None) -> int:
    """`width`, else the terminal's (COLUMNS, then the terminal itself, as the command line reads it), else WIDTH."""
    import shutil

    if width is not None and not (_counts(width) and width >= 1):
        from maskcli.errors import MaskError

        raise MaskError(f"width={width!r}: give the columns to fit, a whole number of 1 or more (or None: the terminal's)")

    return width or shutil.get_terminal_size((WIDTH, 24)).columns


def _console(width: int | None = None):
    import io

    from rich.console import Console

    return Console(width=_width(width), file=io.StringIO())


class Mask(core.Mask):
    """A maskcli.mask.Mask with its views: table(), figure(), summary(), why(), diff(), blocks(), and a notebook display."""

    def __repr__(self) -> str:
        parts = [repr(shortened(self.text, 100)), f"shape={self.shape}"]
        f = self.frame
        if not f.is_plain():
            parts.append(f"positions={f.describe()!r}")
        if self.padding_text:
            parts.append(f"padding={shortened(self.padding_text, 60)!r}")
        return f"Mask({', '.join(parts)})"

    def table(self, convention: str = "keep", dtype: str = "float32", width: int | None = None):
        """The terminal's view as a rich renderable: header, then a table per batch row (an exact density map when wide).

        Sized for `width` columns, else for the terminal's width (COLUMNS), as `maskcli show` is.
        """
        from rich.console import Group

        from maskcli.conventions import CONVENTIONS, DTYPES
        from maskcli.errors import MaskError
        from maskcli.render.masks import mask_views

        if convention not in CONVENTIONS:
            raise MaskError(f"table(): unknown convention {convention!r}: choose one of {', '.join(CONVENTIONS)}")
        if dtype not in DTYPES:
            raise MaskError(f"table(): unknown dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
        return Group(*mask_views(self, convention, dtype, _console(width)))

    def figure(self):
        """A matplotlib Figure: one heatmap per batch row (the exact visible share per block when long)."""
        from maskcli.render.masks import mask_figure

        return mask_figure(self)

    def summary(self, grid: tuple[int, int] = summaries.DEFAULT_GRID) -> Summary:
        """Exact counts: visible cells, keys per query row, empty rows, documents; from the intervals at any length."""
        if not (isinstance(grid, (tuple, list)) and len(grid) == 2 and all(_counts(n) and 1 <= n <= 4096 for n in grid)):
            from maskcli.errors import MaskError

            raise MaskError(f"summary(): grid={grid!r}: give (rows, columns), whole numbers 1 to 4096 each, like (32, 64)")
        found = summaries.summarise(self, tuple(map(int, grid)))
        return Summary(**{f.name: getattr(found, f.name) for f in fields(found)})

    def why(self, q: int, kv: int, b: int | None = None) -> Why:
        """Why the cell (absolute q, kv) is kept or masked, in every batch row (or row b): the tree at that cell."""
        from maskcli.why import explain, parse_cell

        cells = parse_cell(f"{q},{kv}" if b is None else f"{b},{q},{kv}", self, "why")
        return Why(self, [explain(self, *cell) for cell in cells])

    def diff(self, other: core.Mask) -> Difference:
        """Compare with another mask of the same positions: only A, only B, both, and the first rows that differ."""
        if not isinstance(other, core.Mask):
            raise TypeError(f"diff() compares with another Mask (maskcli.build(...)), not a {type(other).__name__}")
        found = diffs.compare(self, other)
        return Difference(**{f.name: getattr(found, f.name) for f in fields(found)})

    def blocks(self, block: int | tuple[int, int] = blockmask.DEFAULT_BLOCK) -> Blocks:
        """FlexAttention's block view (full, partial, empty), as create_block_mask makes it, from the intervals."""
        sizes = list(block) if isinstance(block, (tuple, list)) else [block]
        if not (len(sizes) in (1, 2) and all(_counts(n) and 1 <= n <= 2**40 for n in sizes)):
            from maskcli.errors import MaskError

            raise MaskError(f"blocks(): block={block!r}: give a block size, a whole number 1 to {2**40:,} like 128, or "
                            "(Q, KV) like (128, 64)")
        q_block, kv_block = int(sizes[0]), int(sizes[-1])
        found = blockmask.layout(self, q_block, kv_block)
        return Blocks(**{f.name: getattr(found, f.name) for f in fields(found)})

    def _repr_html_(self) -> str:
        return _html(self.table(width=WIDTH).renderables)


class Summary(summaries.Summary):
    """Exact statistics of a mask; prints as `maskcli show --summary` does, .json() as --summary --json."""

    def __repr__(self) -> str:
        from maskcli.render.summary import summary_text

        return summary_text(self)

    def _repr_html_(self) -> str:
        return _html([repr(self)])


class Difference(diffs.Difference):
    """Two masks compared; .equal, .only_a, .only_b, .both, .rows; shows itself as maskcli diff does."""

    def __repr__(self) -> str:
        verdict = "equal" if self.equal else f"only A allows {self.only_a:,} cells, only B {self.only_b:,}"
        return f"Difference({shortened(self.a.text, 60)!r}, {shortened(self.b.text, 60)!r}: {verdict})"

    def table(self, width: int | None = None):
        """As maskcli diff prints it, for `width` columns, else the terminal's."""
        from rich.console import Group

        from maskcli.render.diff import views

        return Group(*views(self, _console(width)))

    def figure(self):
        from maskcli.render.diff import diff_figure

        return diff_figure(self)

    def _repr_html_(self) -> str:
        return _html(self.table(width=WIDTH).renderables)


class Blocks(blockmask.Blocks):
    """FlexAttention's block view of a mask; .arrays() are the four BlockMask tensors; shows itself as maskcli blocks."""

    def __repr__(self) -> str:
        full, partial, empty = self.counts(0)
        return (f"Blocks({shortened(self.mask.text, 60)!r}, block=({self.q_block}, {self.kv_block}), "
                f"full={full}, partial={partial}, empty={empty}, sparsity={self.sparsity():.2f}%)")

    def table(self, width: int | None = None):
        """As maskcli blocks prints it, for `width` columns, else the terminal's."""
        from rich.console import Group

        from maskcli.render.blocks import views

        return Group(*views(self, _width(width), 48))

    def figure(self):
        from maskcli.render.blocks import blocks_figure

        return blocks_figure(self)

    def _repr_html_(self) -> str:
        return _html(self.table(width=WIDTH).renderables)


class Why:
    """The answer of mask.why(q, kv): .keep, .json(), and the tree in words as its repr.

    .keep is a bool where one cell was asked (a mask of one batch row, or why(q, kv, b=...)), else a list of bools,
    one per batch row.
    """

    def __init__(self, mask: core.Mask, answers: list):
        self.mask, self.answers = mask, answers

    @property
    def keep(self) -> bool | list[bool]:
        kept = [bool(answer.keep) for answer in self.answers]
        return kept[0] if len(kept) == 1 else kept

    def json(self) -> dict:
        from maskcli.render.why import why_json

        return why_json(self.mask, self.answers)

    def __repr__(self) -> str:
        from maskcli.render.why import why_text

        return why_text(self.mask, self.answers)

    def _repr_html_(self) -> str:
        import html

        return f"<pre>{html.escape(repr(self))}</pre>"
