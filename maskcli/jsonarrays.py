"""A JSON nested list of numbers read by numpy: a 4096 x 4096 mask in about a second, not 20 s through json.

`dense_numbers` takes the text of a rectangular nested list of JSON numbers, where maskcli's strings "nan", "inf"
and "-inf" may stand for numbers, and returns the array np.array(json.loads(text)) gives (int64 where every
number is an integer, else float64). Anything else (an object, true/false/null, other strings, ragged or empty
lists, JSON errors, integers of 19 digits or more) gives None, and the caller reads the text with json, which
words the error: this path takes only what JSON takes, and only the common case.

The text is checked as bytes with numpy: whitespace never between two number characters, then, with whitespace
dropped, which byte may follow which (the grammar of arrays of numbers is local but for the brackets' nesting),
each number's characters in JSON's order, and the brackets' nesting (a few per row) for the shape. numpy's
`fromstring` then reads the numbers; it alone would read "1, ,2" as 1, -1, 2.
"""

from __future__ import annotations

import numpy as np

MAX_DEPTH = 64  # deeper lists go the general way (a mask has 2 to 4 dimensions)
_BRACKETS_AS_SPACES = bytes.maketrans(b"[]", b"  ")
_INT64 = np.iinfo(np.int64)
# as maskcli writes them; numpy reads the words. The spaces keep a word off its neighbours: `1"inf"` is
# then "1 inf", two numbers with only whitespace between, refused as JSON refuses the original
_CONSTANTS = {'"-inf"': " -inf ", '"inf"': " inf ", '"nan"': " nan "}


def _table(chars: bytes) -> np.ndarray:
    table = np.zeros(256, dtype=bool)
    table[list(chars)] = True
    return table


# small lookup tables serve the few bytes looked at one by one; whole-text passes compare instead (a gather per
# byte of 33 MB costs a third of a second, a comparison a few hundredths)
_DIGIT, _EXP, _SIGN, _LETTER = _table(b"0123456789"), _table(b"eE"), _table(b"+-"), _table(b"infa")
_ALLOWED, _WHITE = b"0123456789+-.eEinfa \t\n\r[],", b" \t\n\r"
_ORDER = np.zeros(256, dtype=np.int8)  # -, ., e, then the exponent's sign: a number's characters in JSON's order
_ORDER[[ord("."), ord("e"), ord("E"), ord("+")]] = 1, 2, 2, 3
_OPEN, _CLOSE, _COMMA = ord("["), ord("]"), ord(",")


def dense_numbers(text: str) -> np.ndarray | None:
    """The array of a rectangular nested list of JSON numbers, parsed with numpy; None where it is anything else."""
    if not text.isascii() or "-\"" in text:
        return None
    words = 0
    for spelled, word in _CONSTANTS.items():
        if spelled in text:
            words += text.count(spelled)
            text = text.replace(spelled, word)
    data = text.encode("ascii")
    # bytes.translate and bytes.count run at memory speed: the census of the characters, before numpy looks
    if len(data) < 3 or data.translate(None, _ALLOWED) or sum(data.count(c) for c in b"infa") != 3 * words:
        return None  # another character, string, true, null
    if len(data.translate(None, _WHITE)) != len(data):
        raw = np.frombuffer(data, dtype=np.uint8)
        if _split_number(raw, (raw == ord(" ")) | (raw == ord("\n")) | (raw == ord("\t")) | (raw == ord("\r"))):
            return None
        data = data.translate(None, _WHITE)
        if len(data) < 3:  # only whitespace, or a value too short to be a nested list: json words the error
            return None
    census = {c: data.count(c) for c in b"0+-.eE"}
    raw = np.frombuffer(data, dtype=np.uint8)
    structural = (raw == _OPEN) | (raw == _CLOSE) | (raw == _COMMA)
    if not _follows_right(raw, structural) or not _numbers_are_json(raw, structural, census):
        return None
    shape = _shape(raw)
    if shape is None:
        return None
    count = int(np.prod(shape))
    number = ~structural
    if count == number.sum():  # every number one character: 0s and 1s, read off the bytes
        return (raw[number] - ord("0")).astype(np.int64).reshape(shape)
    integers = not (words or census[ord(".")] or census[ord("e")] or census[ord("E")])
    try:
        values = np.fromstring(data.translate(_BRACKETS_AS_SPACES).decode("ascii"), dtype=np.int64 if integers else np.float64, sep=",")
    except ValueError:
        return None
    if values.size != count:
        return None
    if integers and (values.max() == _INT64.max or values.min() == _INT64.min):
        return None  # numpy's reading stops at int64's ends without a word (2**64 reads as 2**63 - 1): json says it
    if not integers and _past_int64(raw):
        return None  # (an integer past int64 beside a float: json keeps it a Python int, an object array: json says it)
    return values.reshape(shape)


def _past_int64(raw: np.ndarray) -> bool:
    """Whether an integer literal (a run of 19 digits or more that is no fraction's, no exponent's) lies past int64."""
    digit = (raw >= ord("0")) & (raw <= ord("9"))
    edges = np.diff(digit.astype(np.int8), prepend=0, append=0)
    starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
    for start, end in zip(*(side[ends - starts >= 19] for side in (starts, ends))):  # (a few, where any)
        before = raw[start - 1] if start else 0
        negative = before == ord("-") and not (start > 1 and raw[start - 2] in b"eE")
        if end < len(raw) and raw[end] in b".eE" or before in b".eE+" or before == ord("-") and not negative:
            continue
        if int(bytes(raw[start:end])) > 2 ** 63 - (0 if negative else 1):
            return True
    return False


def _split_number(raw: np.ndarray, white: np.ndarray) -> bool:
    """Whether a run of whitespace stands between two number characters ("1 2"), which dropping it would join."""
    number = ~(white | (raw == _OPEN) | (raw == _CLOSE) | (raw == _COMMA))
    number = np.concatenate(([False], number, [False]))  # every run has a byte on each side
    white = np.concatenate(([False], white, [False]))
    starts = np.flatnonzero(white[1:] & ~white[:-1]) + 1
    ends = np.flatnonzero(white[:-1] & ~white[1:])
    return bool(np.any(number[starts - 1] & number[ends + 1]))


def _follows_right(raw: np.ndarray, structural: np.ndarray) -> bool:
    """Which byte may follow which in JSON arrays of numbers (no empty list), the text starting '[' and ending ']'."""
    if raw[0] != _OPEN or raw[-1] != _CLOSE:
        return False
    opens, closes = raw == _OPEN, raw == _CLOSE
    ends_item = closes | (raw == _COMMA)
    bad = (opens | (raw == _COMMA))[:-1] & ends_item[1:]  # "[]", "[,", ",]", ",,"
    bad |= closes[:-1] & ~ends_item[1:]  # "]" then "[" or a number
    bad |= ~structural[:-1] & opens[1:]  # a number then "["
    return not bad.any()


def _numbers_are_json(raw: np.ndarray, structural: np.ndarray, census: dict[int, int]) -> bool:
    """Every number is JSON's -?(0|[1-9][0-9]*)(\\.[0-9]+)?([eE][+-]?[0-9]+)?, or one of the words inf, -inf, nan.

    Only the bytes of numbers that are not digits (nor the words' letters, whole by construction) are looked at,
    with their neighbours: a mask of 0s and 1s has none.
    """
    edge = np.array([_COMMA], dtype=np.uint8)
    padded = np.concatenate((edge, raw, edge))  # a neighbour on each side of every byte
    separator = np.concatenate(([True], structural, [True]))
    if census[ord("0")] and _leading_zero(padded, separator):
        return False
    if not any(census[c] for c in b"+-.eE"):
        return True
    special = np.flatnonzero((padded == ord("-")) | (padded == ord(".")) | (padded == ord("e")) | (padded == ord("E")) | (padded == ord("+")))
    at, prev, nxt = padded[special], padded[special - 1], padded[special + 1]
    starts = separator[special - 1]
    minus, after_exp, next_digit = at == ord("-"), _EXP[prev], _DIGIT[nxt]
    order = _ORDER[at]
    order[minus & ~starts] = 3
    bad = minus & ~((starts & (next_digit | _LETTER[nxt])) | (after_exp & next_digit))
    bad |= (at == ord("+")) & ~(after_exp & next_digit)
    bad |= (at == ord(".")) & ~(_DIGIT[prev] & next_digit)
    bad |= _EXP[at] & ~(_DIGIT[prev] & (next_digit | _SIGN[nxt]))
    if bad.any():
        return False
    if special.size < 2:
        return True
    same = np.add.reduceat(separator.view(np.uint8), special, dtype=np.int64)[:-1] == 0  # no separator between
    return not np.any(same & (order[1:] <= order[:-1]))


def _leading_zero(padded: np.ndarray, separator: np.ndarray) -> bool:
    """Whether a number's integer part starts with 0 and goes on ("01", "-01"), which JSON does not allow."""
    zeros = np.flatnonzero((padded[:-1] == ord("0")) & ((padded[1:] - np.uint8(ord("0"))) <= 9))
    if zeros.size == 0:
        return False
    prev = padded[zeros - 1]
    return bool(np.any(separator[zeros - 1] | ((prev == ord("-")) & ~_EXP[padded[np.maximum(zeros - 2, 0)]])))


def _shape(raw: np.ndarray) -> tuple[int, ...] | None:
    """The lists' sizes per depth, where every list at a depth holds as many items and the numbers are in the deepest."""
    brackets = np.flatnonzero((raw == _OPEN) | (raw == _CLOSE))
    opens = raw[brackets] == _OPEN
    depth = np.cumsum(np.where(opens, 1, -1))
    if depth[-1] != 0 or np.any(depth[:-1] < 1):
        return None
    deepest = int(depth.max())
    if deepest > MAX_DEPTH:
        return None
    innermost = opens[:-1] & ~opens[1:]  # '[' then ']': a list of numbers
    if np.any(depth[:-1][innermost] != deepest):
        return None
    gaps = np.diff(brackets)
    between_lists = ~opens[:-1] & opens[1:]  # ']' ... '[': one comma between siblings, nothing more
    if np.any(gaps[between_lists] != 2) or np.any(gaps[~innermost & ~between_lists] != 1):
        return None
    commas = np.add.reduceat((raw == _COMMA).view(np.uint8), brackets, dtype=np.int64)[:-1]  # between each bracket and the next
    items = commas[innermost] + 1
    if np.any(items != items[0]):
        return None
    shape = []
    for level in range(1, deepest):
        lists, children = opens & (depth == level), opens & (depth == level + 1)
        sizes = np.bincount(np.cumsum(lists)[children] - 1, minlength=int(lists.sum()))
        if np.any(sizes != sizes[0]):
            return None
        shape.append(int(sizes[0]))
    return (*shape, int(items[0]))
