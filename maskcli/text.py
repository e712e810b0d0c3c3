"""Small helpers that put numbers into words, help examples into lines, and the Finding that findings are made of."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Finding:
    """What a rule found (maskcli.checks.registry declares each code's rule and its severity).

    `severity` overrides the rule's own where one finding of a code is worse than another (a row that sees no key is a
    note where the kernel gives 0, wrong where it gives NaN); `expected`, `source` and `cell` say what the mask should
    have been, where that expectation came from (a config field, an argument, an earlier step, a kernel's rule) and
    the first cell that differs. `request`, `rank` and `step` say which part of a whole it is about where the rule
    reads more than one: a serving batch's request (serve), a context-parallel rank (shard), a step of a run.
    """

    code: str  # short, stable: fully-masked, row-sum, sees-later, fill-overflow, non-finite
    message: str
    severity: str | None = None
    expected: str | None = None
    source: str | None = None
    cell: tuple | None = None  # (batch row, query, key) as absolute positions where known; (query, key) in a request or a split
    request: int | None = None  # the serving batch's request it is about (serve)
    rank: int | None = None  # the context-parallel rank it is about; None: the split as a whole (shard)
    step: int | None = None  # the step of a run or of step files it is about


def spans(values) -> str:
    """[0, 1, 2, 5] -> '0-2, 5' (a list or an integer array: runs found by numpy, not a loop per value)."""
    import numpy as np

    keys = np.asarray(values, dtype=np.int64).ravel()
    if not keys.size:
        return ""
    breaks = np.flatnonzero(np.diff(keys) != 1)
    starts, ends = keys[np.r_[0, breaks + 1]], keys[np.r_[breaks, keys.size - 1]]
    return ", ".join(f"{s}-{e}" if e != s else f"{s}" for s, e in zip(starts.tolist(), ends.tolist()))


def plane_text(b: int, h: int, shape) -> str:
    """' (batch 1, head 2)': which plane of a (B, H, ...) mask, where there are several."""
    parts = [f"batch {b}"] if shape[0] > 1 else []
    if shape[1] > 1:
        parts.append(f"head {h}")
    return f" ({', '.join(parts)})" if parts else ""


def shell_quote(text: str) -> str:
    """A command-line word: bare where the shell leaves it alone, else in double quotes where that is safe."""
    import shlex

    if all(c.isalnum() or c in "_-.,/=:+" for c in text) and text:
        return text
    if not any(c in text for c in '"$`\\!'):
        return f'"{text}"'
    return shlex.quote(text)


def shortened(text: str, limit: int = 100) -> str:
    """Text for a header or title: whole up to `limit` characters, else its start and end around '...'."""
    if len(text) <= limit:
        return text
    tail = max(10, limit // 5)
    return f"{text[: limit - tail - 5]} ... {text[-tail:]}"


def names_text(names, most: int = 8) -> str:
    """'a', 'b', 'c': names quoted, the first `most` of a long list and how many there are (3,000 names made a line
    of 26,000 characters)."""
    names = list(names)
    shown = ", ".join(repr(name) for name in names[:most])
    return shown if len(names) <= most else f"{shown}, ... ({len(names):,} in all)"


def step_label(step: int, q_len: int) -> str:
    """A module's call number in words: 'prefill' (its first call, of several queries), 'decode N' (a one-query call
    after the first), else 'step N'; N is the number TRACE.pt:PATH@N selects."""
    if step == 0 and q_len > 1:
        return "prefill"
    return f"decode {step}" if q_len == 1 and step > 0 else f"step {step}"


def step_text(steps: list[int], q_len: int) -> str:
    """The calls of a group in the words of step_label: 'prefill', 'decode 1-3', 'prefill, steps 1-2', 'step 0, decode 1'."""
    words = ["prefill"] if q_len > 1 and 0 in steps else ["step 0"] if 0 in steps else []
    rest = [step for step in steps if step > 0]
    if rest:
        words.append(("decode " if q_len == 1 else "step " if len(rest) == 1 else "steps ") + spans(rest))
    return ", ".join(words)


CONTINUED = "    "  # the indent of a wrapped example's further lines


def wrap_example(line: str, width: int) -> list[str]:
    """An example (`maskcli ...  # comment`, or `torchrun ... maskcli ...`) as lines of at most `width` characters, as a shell script writes it:
    a comment too long to follow the command goes on its own `# ` lines above it, and the command breaks at
    spaces (outside quotes where it can) with ` \\` at the end of each line and its further lines indented.

    A word longer than a line is left whole (the terminal folds it)."""
    command, _, comment = line.partition("  # ")
    if len(line) <= width or not line.startswith(("maskcli ", "torchrun ")):  # (maskcli's, or run under a launcher)
        return [line]
    lines = [f"# {text}" for text in _fill(comment.split(), width - 2)] if comment else []
    limit = width - len(CONTINUED) - 2
    pieces, quote, piece = [], None, ""
    for word in command.split(" "):  # a quoted argument is one piece, unless it alone is longer than a line
        if quote is not None and piece and len(piece) + 1 + len(word) > limit:
            pieces.append(piece)
            piece = ""
        piece = f"{piece} {word}" if piece else word
        for char in word:
            quote = None if char == quote else char if quote is None and char in "\"'" else quote
        if quote is None:
            pieces.append(piece)
            piece = ""
    pieces += [piece] if piece else []
    for at in range(len(pieces) - 2, -1, -1):  # an option stays on the line of its value, where both fit
        joined = f"{pieces[at]} {pieces[at + 1]}"
        if pieces[at].startswith("-") and not pieces[at + 1].startswith("-") and len(joined) <= limit:
            pieces[at:at + 2] = [joined]
    rows = _fill(pieces, limit, first=width - 2)
    return lines + [("" if at == 0 else CONTINUED) + row + (" \\" if at < len(rows) - 1 else "") for at, row in enumerate(rows)]


def _fill(words: list[str], width: int, first: int | None = None) -> list[str]:
    """`words` joined by spaces into lines of at most `width` characters (`first` for the first line)."""
    rows: list[str] = []
    for word in words:
        limit = width if rows[1:] or first is None else first
        if rows and len(rows[-1]) + 1 + len(word) <= limit:
            rows[-1] += " " + word
        else:
            rows.append(word)
    return rows
