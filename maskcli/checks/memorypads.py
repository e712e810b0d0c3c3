"""A cross-attention whose every query sees only the memory's padding: the encoder's padding mask turned round.

The model call states its source's padding itself (checks/real.py's `stated`: an `attention_mask`, lengths, or its
input ids at the pad id the program holds, its tokenizer's or its config's) over exactly the keys of a cross-attention
(a decoder over the encoder's memory, the one reading of checks/context.crossing). Where every query of every padded
row sees some key, and exactly the keys that padding calls padding and none it calls real, the mask was inverted once
too often on its way (NeMo#3838: `complete()` inverted the encoder mask, `enc_mask < 0.5`, before the module inverted it
"for Megatron", so the decoder read only the source's pad tokens). Quiet where any query of a padded row sees a real key
or misses a padding one (a partial mask is another rule's), on an unpadded memory, and where the padding is not the
model call's own statement.
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import Run
from maskcli.checks.held import edge_runs
from maskcli.checks.memturned import by_row
from maskcli.checks.real import stated
from maskcli.checks.registry import Rule
from maskcli.text import Finding


def memory_pads_only(run: Run) -> list:
    """Cross-attention calls whose every query of each padded row sees exactly the memory's padding keys."""
    found, done = [], {}
    for call in run.cross:
        top = run.top(call)
        rows, k_len = call.shape[0], call.shape[3]
        if top is None or call.stored is None or not top.arguments:
            continue
        said = stated(top, rows, k_len) or _fixed_length(top.arguments, rows, k_len)
        if said is None:
            continue
        real, source, sure = said
        key = (call.mask, call.shape, real.tobytes())
        if key not in done:
            done[key] = None
            cells = by_row(call, rows)
            padded = ~real.all(axis=1)
            if cells is not None and padded.any() and real.any(axis=1).all():
                if (cells[padded] == ~real[padded][:, None, :]).all():
                    b = int(np.flatnonzero(padded)[0])
                    pads = np.flatnonzero(~real[b]).tolist()
                    said_by = source if source.startswith("input ids") else "the " + source
                    done[key] = Finding("memory-padding-only-attended", (
                        f"every query of each padded batch row sees exactly the memory keys that {said_by} "
                        f"mark{'' if source.startswith('input ids') or source.split(' ')[0].endswith('s') else 's'} as padding and none of its real "
                        f"ones (batch row {b}: keys {pads} only): the source's padding mask was inverted once too often "
                        f"on its way (True = real read as True = masked?)"),
                        None if sure else "suspicious", expected="the memory's real keys", source=source,
                        cell=(b, 0, pads[0]))
        if done[key] is not None:
            found.append((call, done[key]))
    return found


def _fixed_length(arguments: dict, rows: int, length: int) -> tuple[np.ndarray, str, bool] | None:
    """The model call's source ids at its tokenizer's pad id (not its EOS or BOS), one run at an edge of each row that
    leaves a real token, some row padded: a batch padded to a fixed length, no row whole (one prompt padded to the
    encoder's length, NeMo's `masked_sample`), which checks/real.py's `stated` leaves unread (a loss mask over a
    prompt is no tokenizer's pad id)."""
    tokens = next((arguments[n] for n in ("input_ids", "idx", "tokens") if isinstance(arguments.get(n), np.ndarray)),
                  arguments["first_ids"][1] if "first_ids" in arguments else None)
    pad_id = arguments.get("tokenizer_pad_id")
    if tokens is None or tokens.shape != (rows, length) or not isinstance(pad_id, int) \
            or pad_id in {arguments.get(n) for n in ("tokenizer_eos_id", "tokenizer_bos_id")}:
        return None
    pad = tokens == pad_id
    if not edge_runs(~pad, right_only=False):  # (some row padded, none all padding, each at one edge)
        return None
    return ~pad, f"input ids equal to the pad id {pad_id} of {arguments.get('tokenizer', 'the tokenizer')}", True


RULES = (
    Rule("memory-padding-only-attended", "wrong", "call", "a cross-attention whose every query of each padded row "
         "sees exactly the memory keys the model call's own padding (its mask, lengths, ids at the pad id) calls "
         "padding, and no real one: the source's mask inverted once too often", memory_pads_only),
)
