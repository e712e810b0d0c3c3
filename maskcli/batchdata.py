"""What --lengths, --pad, --ids and --tokens say: the key padding of each batch row, and the words on the axes.

Each takes inline values or a file (.npy, .json, .txt, .pt), read as labels are.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np

from maskcli.errors import MaskError
from maskcli.kinds.values import as_array, from_file, is_file_value, parse_rows
from maskcli.memory import check_dense_fits
from maskcli.positions import Frame
from maskcli.text import shortened


def padding(options) -> tuple[tuple[int, ...] | None, np.ndarray | None]:
    if options.lengths is not None and options.ids is not None:
        raise MaskError("give either --lengths or --ids, not both")
    lengths = ids = None
    if options.lengths is not None:
        if not isinstance(options.lengths, str):  # build(lengths=[5, 3]): a list, an array, a tensor
            rows = list(as_array(options.lengths, "lengths="))
        elif is_file_value(options.lengths):
            rows = [row for row in from_file(options.lengths, f"--lengths {options.lengths!r}").array]
        else:
            rows = parse_rows(options.lengths, "--lengths", "4,2")
        if len(rows) > 1:
            raise MaskError(f"--lengths {shortened(str(options.lengths), 60)!r}: one length per batch row, in one row (like 4,2); ';' or lines are for --ids")
        lengths = tuple(rows[0].tolist())
        for value in lengths:
            if value < 0:
                raise MaskError(f"--lengths values must be 0 or more, got {value} in {shortened(str(options.lengths), 60)!r}")
    if options.ids is not None:
        if not isinstance(options.ids, str):
            return lengths, as_array(options.ids, "ids=")
        if is_file_value(options.ids):
            return lengths, from_file(options.ids, f"--ids {options.ids!r}").array
        rows = parse_rows(options.ids, "--ids", "1,2,3,0;4,5,0,0")
        widths = [len(row) for row in rows]  # in row order, so the message reads against what was typed
        if len(set(widths)) > 1:
            raise MaskError(f"--ids {shortened(options.ids, 60)!r}: the batch rows have {', '.join(map(str, widths[:8]))}{', ...' if len(widths) > 8 else ''} tokens, in that order: pad every row to the same length with the pad id")
        ids = np.asarray(rows, dtype=np.int64)
    return lengths, ids


def pad_side(options) -> str:
    if options.pad is None:
        return "right"
    if options.pad not in ("left", "right"):
        raise MaskError(f"unknown --pad {options.pad!r}: choose left or right (Hugging Face's padding_side)")
    if options.lengths is None:
        raise MaskError(f"--pad {options.pad} says where --lengths puts the padding: give --lengths too"
                        + (" (--ids shows the padding where it is)" if options.ids is not None else ""))
    return options.pad


def tokens(text) -> tuple[str, ...]:
    """--tokens: the words (a list of them from Python), or a file of them (.txt: words separated by white space; .json: a list; .npy or .pt:
    token ids, shown as numbers)."""
    if not isinstance(text, str):
        words = [str(word) for word in (text.tolist() if hasattr(text, "tolist") else text)]  # a tensor of ids: numbers
    elif is_file_value(text) and len(text.split()) == 1:
        path = Path(text)
        where = f"--tokens {text!r}"
        if path.suffix.lower() in (".txt", ".json"):
            from maskcli.files import readable_file, state

            if state(path) == "missing":
                raise MaskError(f"{where}: no such file (to label a position with that word, give more than one word)")
            readable_file(text, where)
            try:
                content = path.read_text()
                words = content.split() if path.suffix.lower() == ".txt" else json.loads(content)
            except (OSError, UnicodeDecodeError, ValueError) as error:
                raise MaskError(f"{where}: cannot read words from it ({' '.join(str(error).split())[:120]})") from None
            if not isinstance(words, list) or not all(isinstance(word, (str, int)) and not isinstance(word, bool) for word in words):
                raise MaskError(f"{where}: a .json of tokens is one list of words or ids, like [\"Your\", \"journey\"]")
            words = [str(word) for word in words]
        else:
            array = from_file(text, where).array
            if array.shape[0] != 1:
                raise MaskError(f"{where}: the file holds {array.shape[0]} rows of token ids; --tokens labels one row")
            words = [str(value) for value in array[0].tolist()]
    else:
        words = text.split()
    if not words:
        raise MaskError(f"--tokens {shortened(str(text), 60)!r} has no words: give one word per position")
    return tuple("".join(c if c.isprintable() else repr(c)[1:-1] for c in word) for word in words)  # (an ESC in a
    # word recoloured the terminal, a newline broke the table's row: shown as \x1b, \n)


def longest(lengths) -> tuple[str, int] | None:
    """Without --len or labels, the longest of --lengths is the sequence (padded to it)."""
    return ("the longest of --lengths", max(lengths)) if lengths else None


def with_padding(frame: Frame, lengths, ids, pad_id: int, pad_side: str = "right") -> Frame:
    n = frame.n
    if lengths is not None:
        for value in lengths:
            if value > n:
                raise MaskError(
                    f"length {value} in --lengths is larger than the sequence ({n} positions, {frame.describe()}): "
                    "raise --len or shorten the length"
                )
        check_dense_fits((len(lengths), n), 1, "for the key padding", fix="use fewer batch rows or a shorter sequence")
        valid = np.arange(n)[None, :] < np.asarray(lengths)[:, None]
        if pad_side == "left":
            valid = valid[:, ::-1].copy()
        return replace(frame, key_valid=valid, lengths=lengths, pad_side=pad_side)
    if ids is not None:
        check_pad_id(pad_id)
        if ids.shape[1] != n:
            raise MaskError(
                f"--ids rows have {ids.shape[1]} tokens but the sequence has {n} positions ({frame.describe()}): "
                "give one id per position"
            )
        return replace(frame, key_valid=ids != pad_id, ids=ids, pad_id=pad_id)
    return frame


def check_pad_id(pad_id: int) -> None:
    """--pad-id within the ids' own limit: past it no id can be the pad id. Checked whether or not --ids is given,
    as every integer option is: a value no int64 holds is a typo, not a setting to ignore."""
    if abs(pad_id) > 1 << 62:
        raise MaskError(f"--pad-id {pad_id} is too large (at most ±{1 << 62:,}, as every id is): give the token id --ids pads with")
