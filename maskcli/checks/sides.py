"""A seq2seq model's two sides, each padded with its own pad id: the masks read against the side their keys belong to.

A hand-written encoder-decoder states its source and target tokens as arguments of its forward (`src` /
`source`, `trg` / `tgt` / `target`, or the same with `_ids`) and each side's pad id as its own attribute or
config field (`src_pad_idx`, `trg_pad_idx`, `tgt_pad_id` and their kin: trace/tops.py). Tokens at a side's pad id
in a run at one end of each row are that side's padding; any other token is real, even where its id is the
other side's pad id. A call's side is its module path's (`enc...` / `encoder` for the source, `dec...` /
`decoder` for the target, a word of its own or the first of one: `decoder_self_attn`); a cross-attention's keys are
the source's and its queries the target's; where
the path says nothing a call is read against the one side whose length its keys have. On that side:

- a real query that sees a padded key is `padding-ignored` (as arguments.py's, for the side it names);
- a real query of a self-attention that sees no key at all, while its batch row has real keys, is
  `real-query-blind`: every self-attention lets a token see at least itself, so the mask took a real token for
  padding (a pad test run with the other side's pad id). The same holds for the single pad id a model states
  (real.py's statement), so a real token masked out as a query is found in any model.
"""

from __future__ import annotations

import re

import numpy as np

from maskcli.checks.context import Run, cross, first_cell, keep
from maskcli.checks.nans import nan_rows
from maskcli.checks.real import kept_turned, stated_once
from maskcli.checks.registry import Rule
from maskcli.checks.tiled import batch_part
from maskcli.text import Finding, spans

SOURCE = ("src", "source", "src_ids", "source_ids", "input_src", "src_input", "src_tokens", "source_tokens", "src_seq",
          "source_seq")
TARGET = ("trg", "tgt", "target", "trg_ids", "tgt_ids", "target_ids", "input_trg", "input_tgt", "trg_tokens", "tgt_tokens",
          "trg_seq", "tgt_seq", "target_seq", "trg_input", "tgt_input", "target_input")
ENCODER = re.compile(r"(?:^|\.)(?:enc|encoder|src|source)(?:_?layers?|_?blocks?|oder)?(?:[._]|$)", re.IGNORECASE)
DECODER = re.compile(r"(?:^|\.)(?:dec|decoder|trg|tgt|target)(?:_?layers?|_?blocks?|oder)?(?:[._]|$)", re.IGNORECASE)


def side_tokens(top, side: str, shape: tuple[int, int] | None = None) -> tuple[np.ndarray, str] | None:
    """(bool (B, L) real tokens, where it is said) of one side ("src" or "trg") of the model call; None if unstated.
    `shape`: the (B, L) a call reads them as, where tokens handed time-major, (L, B) as nn.LSTM and nn.Transformer take
    them by default, are read turned (mead-baseline's `src` T x B: its batch rows are its columns)."""
    pad = top.arguments.get(f"{side}_pad_id")
    if not isinstance(pad, int):
        return None
    for name in SOURCE if side == "src" else TARGET:
        tokens = top.arguments.get(name)
        if isinstance(tokens, np.ndarray) and tokens.ndim == 2 and tokens.size:
            major = shape is not None and shape[0] != shape[1] and tokens.shape == shape[::-1]
            padded = (tokens.T if major else tokens) == pad
            if padded.any() and not _at_one_end(padded):
                return None  # (the pad id inside a row: a real word there, not padding by this statement)
            turned = f" (time-major, {tokens.shape}: read as {shape})" if major else ""
            return ~padded, f"`{name}` of {top.where} at its pad id {pad} ({side}_pad_idx){turned}"
    return None


def _at_one_end(pad: np.ndarray) -> bool:
    """Each row's pad ids one run at its end, or each row's one run at its start, no row all padding."""
    if pad.all(axis=1).any():
        return False
    count = pad.sum(axis=1, keepdims=True)
    columns = np.arange(pad.shape[1])[None, :]
    return bool(((columns >= pad.shape[1] - count) == pad).all() or ((columns < count) == pad).all())


def encoder_path(where: str | None) -> bool:
    """A module path that names an encoder and no decoder (`model.encoder.layers.0.self_attn`,
    `encoder.block.0.layer.0.TransientGlobalSelfAttention`): the program's word that the attention there is an
    encoder's, seeing both ways."""
    return bool(ENCODER.search(where or "")) and not DECODER.search(where or "")


def beside_encoder(run: Run, call) -> bool:
    """The call is a decoder's (its module path says so) in a run whose calls hold an encoder too: a flag said for the
    whole program (SpeechBrain's hparams `causal: False`) is its encoder's, the decoder beside it causal by design."""
    if not DECODER.search(call.where or "") or ENCODER.search(call.where or ""):
        return False
    held = run.__dict__.get("_encoded")
    if held is None:
        held = run.__dict__["_encoded"] = any(encoder_path(one.where) for one in run.calls)
    return held


def _side(call, lengths: dict) -> str | None:
    where = getattr(call, "where", "") or ""
    encoder, decoder = bool(ENCODER.search(where)), bool(DECODER.search(where))
    if encoder != decoder:
        return "src" if encoder else "trg"
    fits = [side for side, length in lengths.items() if length == call.shape[3]]
    return fits[0] if len(fits) == 1 else None


def _fits(real: np.ndarray, rows: int, length: int) -> np.ndarray | None:
    if real.shape[1] != length or real.shape[0] not in (1, rows):
        return None
    return np.broadcast_to(real, (rows, length))


def sides(run: Run) -> list:
    """Per call, its side's real keys and queries against the cells: padded keys seen, real queries that see nothing."""
    found, done, statements, sided = [], set(), {}, {}
    for call in [*run.calls, *run.cross]:
        top = run.top(call)
        if top is None or call.stored is None or not top.arguments:
            continue
        rows, _, q_len, k_len = call.shape
        if id(top) not in sided:  # (each model call's sides read once: every layer of it asks the same)
            sided[id(top)] = {side: read for side in ("src", "trg") if (read := side_tokens(top, side)) is not None}
        said = sided[id(top)]
        crossing = cross(call)
        if said:
            if crossing:
                keys_side, queries_side = "src", "trg"
            else:
                keys_side = queries_side = _side(call, {side: real.shape[1] for side, (real, _) in said.items()})
            if keys_side not in said or queries_side not in said:
                continue
            keys_real = _fits(said[keys_side][0], rows, k_len)
            if crossing:
                own_real = _fits(said[queries_side][0], rows, q_len)
            else:
                own = run.placed(call)[1]
                own_real = None if keys_real is None or own.max(initial=-1) >= k_len or own.min(initial=0) < 0 \
                    else keys_real[:, own]
            source, sure, judge_keys = said[keys_side][1], True, True
        elif not crossing and run.placed(call)[2] and not getattr(top.config, "is_encoder_decoder", False) \
                and not batch_part(call):  # (a chunk of a larger batch: not the model call's rows, tiled.py)
            # (an encoder-decoder's attention_mask is its encoder's: its decoder's keys are other tokens)
            statement = stated_once(statements, top, rows, k_len)
            if statement is None or not statement[2]:
                continue
            keys_real, source, _ = statement
            own = run.placed(call)[1]
            own_real = None if own.max(initial=-1) >= k_len or own.min(initial=0) < 0 else keys_real[:, own]
            sure, judge_keys = True, False  # (a padded key seen: arguments.py's, for this statement)
        else:
            continue
        cells = keep(call)  # (asked once the call states a side: most calls of a run state none)
        if keys_real is None or own_real is None or cells is None or cells.shape[0] not in (1, rows):
            continue
        key = (call.mask, call.shape, keys_real.tobytes(), own_real.tobytes(), crossing)
        if key in done:
            continue
        done.add(key)
        seen = np.broadcast_to(cells.any(axis=1), (rows, q_len, k_len))
        if not judge_keys and kept_turned(source, keys_real, seen, run.placed(call)[1]):
            continue  # (a `padding_mask` True on the tokens, Keras's way round, kept to exactly: real.kept_turned)
        if judge_keys:
            bad = seen & own_real[:, :, None] & ~keys_real[:, None, :]
            if bad.any():
                b, q, k = first_cell(bad)
                found.append((call, Finding("padding-ignored", (
                    f"batch row {b}: query {q} sees key {k}, which {source} marks as padding ({int(bad.sum())} such "
                    f"cells)"), expected="no real query sees a padding key", source=source, cell=(b, q, k))))
        if crossing:
            continue  # (a decoder token before any memory it may read: mllama's cross rows, masked on purpose)
        blind = own_real & ~seen.any(axis=-1) & keys_real.any(axis=1)[:, None] \
            & ~np.broadcast_to(nan_rows(call), (rows, q_len))  # (a row whose scores hold a NaN: no mask hid its
        # keys, an earlier call's NaN came through, which nans.py says)
        if blind.any():
            b, q = (int(x) for x in np.argwhere(blind)[0])
            which = np.flatnonzero(blind[b]).tolist()
            found.append((call, Finding("real-query-blind", (
                f"batch row {b}: quer{'y' if len(which) == 1 else 'ies'} {spans(which)} {'sees' if len(which) == 1 else 'see'}"
                f" no key at all, not even {'its' if len(which) == 1 else 'their'} own, though by {source} "
                f"{'it is a real token' if len(which) == 1 else 'they are real tokens'} ({int(blind.sum())} such rows): a "
                f"real token masked as padding (a pad test with another pad id, or the wrong way round?)"),
                expected="every real query sees at least its own key", source=source, cell=(b, q, q))))
    return found


RULES = (
    Rule("real-query-blind", "wrong", "steps", "a real token's query (by the model call's statement of its padding, "
         "each side's pad id in a seq2seq model) that sees no key in a self-attention", sides),
)
