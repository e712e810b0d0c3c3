"""Real keys a self-attention's key mask hides from every query, where the lengths the program holds call them real.

A function of the program on the stack holds the batch's lengths (trace/held.py: 1-D `lengths`, `src_lens`, ...; or a
(B, k) tensor of a few lengths a row, `*_length(s)`, each column one reading: Sockeye's `valid_length`, each row's
(total length, prepended length)). Where a self-attention over as many queries as keys keeps to such lengths (no real
query sees a key they call padding) and yet hides, from every real query of a row, a key they call real, and those
hidden keys are not one run with the padding (a shorter sequence's lengths read over a longer one would be), the
mask was built for another attention: Sockeye 3.1.33's `prepare_source_length_mask` defaulted to also masking the
prepended source tokens (meant for the decoder's cross-attention only), and the encoder's self-attention, which never
passed the flag, hid them from every source token (awslabs/sockeye#1087).

Each column that is a padded batch's lengths (every row one real token at least, one row whole, one row not) is read
right- and left-padded; the rule speaks only where one reading the mask keeps to leaves such real keys hidden and
no reading accounts for the mask (kept to, its hidden keys one run with the padding). A position whose own query sees
no key either is no token by the mask's word (FunASR's streaming chunks lay look-back slots between the frames, which
the lengths count and the chunk mask hides as query and as key): not a hidden real key. Quiet on cross-attention, on a
cache (fewer queries than keys), and where a padding mask the program also holds is kept to exactly (two statements
of the padding, the mask's own among them).
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import Run, cross, keep
from maskcli.checks.held import readings
from maskcli.checks.real import by_row
from maskcli.checks.registry import Rule
from maskcli.text import Finding


def _columns(held: dict, length: int) -> list[tuple[str, np.ndarray]]:
    """(which, bool (B, L) real keys) for each way `held`'s lengths lie over `length` keys; [] for other kinds."""
    table = held["rows"]
    if held["kind"] == "lengths" and table.ndim == 1:
        columns = [(held["name"], table)]
    elif held["kind"] == "columns" and table.ndim == 2:
        columns = [(f"{held['name']}[:, {at}]", table[:, at]) for at in range(table.shape[1])]
    else:
        return []
    found, at = [], np.arange(length)[None, :]
    for name, count in columns:
        if count.min() < 1 or count.max() != length or count.min() == length:
            continue  # (no padded batch's lengths: a prepended count, a row of none)
        found += [(f"{name} right-padded", at < count[:, None]), (f"{name} left-padded", at >= length - count[:, None])]
    return found


def _one_run_with_padding(hidden: np.ndarray, real: np.ndarray) -> bool:
    """The keys hidden from every real query of a row, with the padding, are one run at one edge (a shorter sequence's
    lengths: nothing but where the padding starts differs)."""
    out = hidden | ~real
    count = int(out.sum())
    return bool(out[:count].all() or out[out.size - count:].all())


def _read_against(rows: np.ndarray, real: np.ndarray) -> tuple[int, int] | bool:
    """(batch row, key) of the first real key no real query of its row sees, where the mask keeps to `real` (no real
    query sees a key it calls padding) and some row's hidden keys are no run with its padding; True where the reading
    accounts for the mask (kept to, every row's hidden keys one run with its padding); False otherwise (the mask lets
    a real query see what it calls padding: a reading of no use here, held.py's padding-unused reads that way)."""
    seen = (rows & real[:, :, None]).any(axis=1)  # (B, Lk) keys some real query sees
    if (seen & ~real).any():
        return False
    hidden = real & ~seen & rows.any(axis=2)  # (a position that sees no key either: no token, by the mask's own word)
    apart = [b for b in np.flatnonzero(hidden.any(axis=1)) if not _one_run_with_padding(hidden[b], real[b])]
    return (int(apart[0]), int(np.flatnonzero(hidden[apart[0]])[0])) if apart else True


def real_keys_hidden(run: Run) -> list:
    """Self-attention calls whose key mask hides real keys, by every reading of the lengths the program holds."""
    found, done = [], set()
    for call in run.calls:
        helds = call.details.get("held_padding") or ()
        batch, q_len, k_len = call.shape[0], call.shape[2], call.shape[3]
        if q_len != k_len or q_len < 2 or cross(call) or not any(h["kind"] in ("columns", "lengths") for h in helds):
            continue
        key = (call.mask, tuple(call.shape))
        if key in done:
            continue
        done.add(key)
        cells = keep(call)
        if cells is None or cells.shape[0] not in (1, batch):
            continue
        rows = by_row(cells, batch)
        seen = rows.any(axis=1)
        if any(np.array_equal(seen, real) for held in helds for real in readings(held, batch, k_len)):
            continue  # (a padding mask the program holds, kept to exactly)
        for held in helds:
            ways = [(name, real) for name, real in _columns(held, k_len) if real.shape[0] == batch]
            read = [(name, real, _read_against(rows, real)) for name, real in ways]
            hits = [(name, real, hit) for name, real, hit in read if isinstance(hit, tuple)]
            if not hits or any(hit is True for _, _, hit in read):
                continue  # (no reading the mask keeps to hides real keys apart from the padding; or one accounts for it)
            name, real, (b, k) = hits[0]
            count = int((~seen[b] & real[b]).sum())
            q = int(np.flatnonzero(real[b])[0])  # (the row's first real query, by that reading)
            found.append((call, Finding("real-keys-hidden", (
                f"batch row {b}: key {k} is a real token by the lengths the program holds ({held['name']} in "
                f"{held['where']}, read {name}), yet no query of this self-attention sees it ({count} real keys of the "
                f"row hidden from every query), while the mask keeps to those lengths' padding: a key mask built for "
                f"another attention, or combined with a mask of other real tokens (a prefix, a prompt)"),
                expected=f"every real key of the row ({name}) seen", source=f"{held['name']} in {held['where']}",
                cell=(b, q, k))))
            break
    return found


RULES = (
    Rule("real-keys-hidden", "wrong", "call", "a self-attention's key mask hides real tokens from every query, where "
         "the lengths the program holds call them real and the mask keeps to their padding (Sockeye#1087: the "
         "prepended source tokens masked in the encoder)", real_keys_hidden),
)
