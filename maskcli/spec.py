"""Parse what the user typed into one immutable MaskSpec, and validate it there.

Nothing here imports torch: bad input is refused before the slow import, and
`maskcli --help` stays fast. Code downstream trusts a MaskSpec.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from maskcli.errors import MaskError

KINDS: dict[str, str] = {
    "causal": "kv <= q: each token sees itself and every earlier token",
    "tril": "the raw torch.tril(ones, D) matrix, read as keep (default) or block",
    "triu": "the raw torch.triu(ones, D) matrix, read as block (default) or keep",
    "padding": "keys at or past each batch row's length are hidden (bidirectional)",
    "prefill": "N new queries at positions P..P+N-1 over P+N cached keys (bottom-right causal)",
    "chunk": "label[kv] <= label[q]: a token sees its own chunk and every earlier chunk",
    "window": "causal, each query sees itself and the W-1 keys before it",
    "prefix": "the first P tokens see each other both ways, the rest is causal",
    "document": "label[kv] == label[q] and kv <= q: causal inside each packed document",
}

CONVENTIONS: dict[str, str] = {
    "keep": "bool, True = may attend (SDPA attn_mask, FlexAttention create_mask)",
    "block": "bool, True = masked (nn.MultiheadAttention attn_mask / key_padding_mask)",
    "additive": "float, 0 = attend, -inf = masked (added to the scores)",
    "min": "float, 0 = attend, finfo(dtype).min = masked (Hugging Face eager masks)",
    "int": "integer, 1 = attend, 0 = masked (torch.tril(torch.ones(L, L)))",
}

DTYPES = ("float32", "float16", "bfloat16", "float64")
FILLS = ("-inf", "min", "-1e9", "multiply")
STAGES = ("scores", "scaled", "masked", "weights", "output")
DEFAULT_LEN = 8
MAX_LEN = 1 << 40  # positions are int64 and long masks are only ever sampled; past this nothing is useful

_DEFAULT_DIAGONAL = {"tril": 0, "triu": 1}
_DEFAULT_MEANS = {"tril": "keep", "triu": "block"}
_LABELED = ("chunk", "document")


def parse_ints(text: str, what: str, example: str = "0,0,1,1") -> tuple[int, ...]:
    """Parse comma-separated integers; the error names `what` and the bad item's position."""
    items = [item.strip() for item in text.split(",")]
    if text.strip() == "" or all(item == "" for item in items):
        raise MaskError(f"{what} are empty: give comma-separated integers such as {example}")
    values = []
    for position, item in enumerate(items):
        try:
            values.append(int(item))
        except ValueError:
            raise MaskError(
                f"{what} must be integers, got {item!r} at position {position} of {text!r} "
                f"(write them like {example})"
            ) from None
    return tuple(values)


def parse_ids(text: str) -> tuple[tuple[int, ...], ...]:
    """Token ids per batch row: `1,2,3,0;4,5,0,0` (';' between rows, all rows one length)."""
    rows = tuple(parse_ints(row, "token ids", "1,2,3,0;4,5,0,0") for row in text.split(";"))
    widths = sorted({len(row) for row in rows})
    if len(widths) > 1:
        raise MaskError(
            f"token id rows in {text!r} have different lengths {widths}: pad every row "
            "to the same length with the pad id"
        )
    return rows


def parse_tokens(text: str) -> tuple[str, ...]:
    """Words that label the axes: split on white space."""
    tokens = tuple(text.split())
    if not tokens:
        raise MaskError(f"--tokens {text!r} has no words: give one word per position")
    return tokens


def parse_stages(text: str) -> tuple[str, ...]:
    """`scores,masked,weights` -> names, each one of STAGES, in the order given."""
    names = tuple(dict.fromkeys(name.strip() for name in text.split(",") if name.strip()))  # each once, in order
    if not names:
        raise MaskError(f"--stages {text!r} names no stage: choose from {', '.join(STAGES)}")
    for name in names:
        check_choice(name, STAGES, "stage in --stages")
    return names


def check_choice(value: str, choices, what: str) -> str:
    if value not in choices:
        raise MaskError(f"unknown {what} {value!r}: choose one of {', '.join(choices)}")
    return value


@dataclass(frozen=True)
class MaskSpec:
    """A validated description of one mask; `maskcli.masks.build` turns it into a Mask."""

    kind: str
    q_len: int
    k_len: int
    batch: int = 1
    heads: int = 1
    offset: int = 0
    diagonal: int | None = None
    means: str | None = None
    window: int | None = None
    prefix: int | None = None
    labels: tuple[int, ...] | None = None
    lengths: tuple[int, ...] | None = None
    key_valid: tuple[tuple[bool, ...], ...] | None = None
    ids: tuple[tuple[int, ...], ...] | None = None
    pad_id: int | None = None
    tokens: tuple[str, ...] | None = None
    warnings: tuple[str, ...] = field(default=(), compare=False)

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.batch, self.heads, self.q_len, self.k_len)

    @property
    def padded(self) -> bool:
        return self.key_valid is not None

    @property
    def name(self) -> str:
        """Readable name for titles and file names, like `sliding_window_3`."""
        if self.kind in _DEFAULT_MEANS:
            base = f"{self.kind}_{self.diagonal}"
        elif self.kind == "prefill":
            base = f"prefill_offset_{self.offset}"
        elif self.kind == "window":
            base = f"sliding_window_{self.window}"
        elif self.kind == "prefix":
            base = f"prefix_lm_{self.prefix}"
        else:
            base = self.kind
        if self.kind in _DEFAULT_MEANS and self.means != _DEFAULT_MEANS[self.kind]:
            base += f"_as_{self.means}"
        if self.padded and self.kind != "padding":
            base += "_padded"
        return base

    @property
    def params(self) -> dict:
        """The parameters that define this mask, as JSON-ready values."""
        params: dict = {}
        if self.kind in _LABELED:
            params["chunks"] = list(self.labels)
        else:
            params["len"] = self.q_len
        if self.kind == "prefill":
            params["offset"] = self.offset
        if self.kind in _DEFAULT_MEANS:
            params["diagonal"] = self.diagonal
            params["means"] = self.means
        if self.kind == "window":
            params["window"] = self.window
        if self.kind == "prefix":
            params["prefix"] = self.prefix
        if self.lengths is not None:
            params["lengths"] = list(self.lengths)
        if self.ids is not None:
            params["ids"] = [list(row) for row in self.ids]
            params["pad_id"] = self.pad_id
        if self.heads != 1:
            params["heads"] = self.heads
        return params

    def describe(self) -> str:
        return describe(self.kind, self.params)


def describe(kind: str, params: dict) -> str:
    """`kind k=v ...` for titles: `prefill len=2 offset=3`."""
    parts = [kind]
    for key, value in params.items():
        if isinstance(value, list):
            rows = value if value and isinstance(value[0], list) else [value]
            value = ";".join(",".join(map(str, row)) for row in rows)
        parts.append(f"{key}={value}")
    return " ".join(parts)


def _positive(value: int | None, flag: str, what: str) -> None:
    if value is not None and value < 1:
        raise MaskError(f"{flag} must be at least 1 ({what}), got {value}")


def make_spec(
    kind: str,
    *,
    length: int | None = None,
    diagonal: int | None = None,
    means: str | None = None,
    lengths: str | None = None,
    ids: str | None = None,
    pad_id: int = 0,
    offset: int | None = None,
    chunks: str | None = None,
    window: int | None = None,
    prefix: int | None = None,
    heads: int = 1,
    tokens: str | None = None,
) -> MaskSpec:
    """Validate the options of one mask and resolve its sizes.

    Options that do not belong to `kind` are refused rather than ignored, since a
    silently ignored `--window` is exactly the kind of mistake this tool is for.
    """
    check_choice(kind, KINDS, "mask kind")
    warnings: list[str] = []

    def refuse(flag: str, value, allowed: str) -> None:
        if value is not None:
            raise MaskError(f"{flag} {value} does not apply to {kind!r}: it is for {allowed}")

    if kind not in _DEFAULT_MEANS:
        refuse("--diagonal", diagonal, "tril and triu")
        refuse("--means", means, "tril and triu")
    if kind != "prefill":
        refuse("--offset", offset, "prefill")
    if kind != "window":
        refuse("--window", window, "window")
    if kind != "prefix":
        refuse("--prefix", prefix, "prefix")
    if kind not in _LABELED:
        refuse("--chunks", chunks, "chunk and document")

    if kind == "window" and window is None:
        raise MaskError("window needs --window W: each query then sees itself and the W-1 keys before it")
    if kind == "prefix" and prefix is None:
        raise MaskError("prefix needs --prefix P: the number of leading tokens that see each other both ways")
    _positive(length, "--len", "the number of query positions")
    _positive(heads, "--heads", "the number of attention heads")
    _positive(window, "--window", "a query sees itself and the W-1 keys before it")
    _positive(prefix, "--prefix", "the number of bidirectional prefix tokens")
    for flag, value in (("--len", length), ("--offset", offset), ("--window", window), ("--prefix", prefix)):
        if value is not None and value > MAX_LEN:
            raise MaskError(f"{flag} {value} is too large: at most {MAX_LEN:,}")
    if offset is not None and offset < 0:
        raise MaskError(f"--offset must be 0 or more (tokens already in the KV cache), got {offset}")
    offset = offset or 0
    if means is not None:
        check_choice(means, ("keep", "block"), "--means")
    if kind in _DEFAULT_MEANS:
        diagonal = _DEFAULT_DIAGONAL[kind] if diagonal is None else diagonal
        means = means or _DEFAULT_MEANS[kind]

    if lengths is not None and ids is not None:
        raise MaskError("give either --lengths or --ids, not both")
    if kind == "padding" and lengths is None and ids is None:
        raise MaskError("padding needs --lengths (like 4,2) or --ids (like '1,2,3,0;4,5,0,0' with --pad-id 0)")

    labels = None
    if kind in _LABELED:
        if chunks is None:
            raise MaskError(f"{kind} needs --chunks: one integer label per token, like 0,0,1,1")
        labels = parse_ints(chunks, "chunk labels")
        for position in range(1, len(labels)):
            if kind == "chunk" and labels[position] < labels[position - 1]:
                warnings.append(
                    f"chunk labels go down at position {position} ({labels[position - 1]} then "
                    f"{labels[position]}): label[kv] <= label[q] then lets earlier tokens see later ones"
                )
                break

    parsed_tokens = parse_tokens(tokens) if tokens is not None else None
    parsed_lengths = parse_ints(lengths, "--lengths values", "4,2") if lengths is not None else None
    parsed_ids = parse_ids(ids) if ids is not None else None
    if parsed_lengths is not None:
        for value in parsed_lengths:
            if value < 0:
                raise MaskError(f"--lengths values must be 0 or more, got {value} in {lengths!r}")

    # Sizes: the keys are the whole sequence; prefill's queries are its last q_len positions.
    if labels is not None:
        if length is not None and length != len(labels):
            raise MaskError(f"--len {length} does not match the {len(labels)} chunk labels: drop --len")
        q_len = len(labels)
    elif length is not None:
        q_len = length
    elif parsed_lengths is not None or parsed_ids is not None:
        k_len = max(parsed_lengths) if parsed_lengths is not None else len(parsed_ids[0])
        q_len = k_len - offset
        if q_len < 1:
            raise MaskError(
                f"the longest sequence ({k_len}) leaves no new query after --offset {offset}: give --len"
            )
    elif parsed_tokens is not None:  # one word per key position: the words say how long the sequence is
        q_len = len(parsed_tokens) - offset
        if q_len < 1:
            raise MaskError(f"--tokens has {len(parsed_tokens)} words, which leave no new query after --offset {offset}: give more words")
    else:
        q_len = DEFAULT_LEN
    k_len = q_len + offset

    if prefix is not None and prefix > k_len:
        raise MaskError(f"--prefix {prefix} is longer than the sequence ({k_len} tokens): use at most {k_len}")

    key_valid = None
    batch = 1
    if parsed_lengths is not None:
        for value in parsed_lengths:
            if value > k_len:
                raise MaskError(
                    f"length {value} in --lengths {lengths!r} is larger than the sequence length {k_len}: "
                    f"raise --len or shorten the length"
                )
        key_valid = tuple(tuple(k < value for k in range(k_len)) for value in parsed_lengths)
        batch = len(parsed_lengths)
    if parsed_ids is not None:
        if len(parsed_ids[0]) != k_len:
            raise MaskError(
                f"--ids rows have {len(parsed_ids[0])} tokens but the sequence has {k_len} positions: "
                "give one id per key position"
            )
        key_valid = tuple(tuple(token != pad_id for token in row) for row in parsed_ids)
        batch = len(parsed_ids)

    if parsed_tokens is not None and len(parsed_tokens) != k_len:
        raise MaskError(
            f"--tokens has {len(parsed_tokens)} words but the mask has {k_len} key positions: "
            f"give exactly {k_len} words"
        )

    return MaskSpec(
        kind=kind,
        q_len=q_len,
        k_len=k_len,
        batch=batch,
        heads=heads,
        offset=offset,
        diagonal=diagonal,
        means=means,
        window=window,
        prefix=prefix,
        labels=labels,
        lengths=parsed_lengths,
        key_valid=key_valid,
        ids=parsed_ids,
        pad_id=pad_id if parsed_ids is not None else None,
        tokens=parsed_tokens,
        warnings=tuple(warnings),
    )
