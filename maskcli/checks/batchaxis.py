"""Attention along the batch axis: a call whose keys are the batch's samples and whose batch is their tokens.

The model call's token ids (B, L) say which of their axes is the batch: the program's own pad id (its config's, its
embedding's `padding_idx`, its tokenizer's) runs at one end of every row along the token axis, and some row has none.
A call of that model whose keys are as many as the samples and whose batch rows as many as their tokens (B != L)
attends from each sample to the same position of the other samples, never to the other tokens of its own:
nn.MultiheadAttention / nn.Transformer*Layer left at batch_first=False and handed (batch, seq, embed)
(Molecule-Generator#22), or a hand-written attention handed the wrong transpose. Quiet where the ids' padding runs
along both axes or neither (nothing says which is the batch; `input_ids` / `idx` / `tokens` are (batch, seq) as
transformers names them), where a row holds fewer than 3 tokens, on time-major ids whose padding runs down the columns
when the call's keys are the columns' tokens (OpenNMT's `src`), and on a call that sees no other key than its own.

A program that runs its model again on one sample of a batch (every tensor argument one row of the batch's, the same
values: trace/samplerows.py) states that their first axis is the batch, ids or not (a table's features,
DeepTab's FT-Transformer). A call of the batch whose keys are as many as its samples (B > 1) and whose batch rows are
not, where the same site run on the one sample has one key and the same batch rows (its keys follow the samples,
its batch rows do not), attends across the batch (DeepTab d2abc5a: nn.TransformerEncoderLayer left at
batch_first=False). Quiet where the site's keys are the same in both runs (the tokens of each sample). Each call is
held against the site's call of the same turn in the run alone: a beam search re-running its growing prefix has 1 key
at its first turn and as many as the batch's samples at some later one, in both runs (CodeXGLUE's, quiet-zx).

A batch a DataLoader's default collate stacked, (B, T, D), handed to the model (trace/loaderbatch.py) states that its
first axis is the samples too: a call whose keys are its B samples and whose batch rows its T steps attends across the
batch (BreizhCrops#20: a seq-first nn.TransformerEncoder handed the (N, T, D) parcel series).
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import Run, first_cell, keep
from maskcli.checks.real import SOURCE, _edge, handed_ids
from maskcli.checks.registry import Rule
from maskcli.text import Finding

IDS = ("input_ids", "idx", "tokens", "src", "source", "src_ids", "source_ids", "src_tokens", "input_src")
MAJOR = ("input_ids", "idx", "tokens")  # batch-major by convention; `src` may be time-major (OpenNMT's)


def _ids(arguments: dict) -> tuple[str, np.ndarray, int, str] | None:
    """(name, ids, pad id, where the pad id is said) of the model call's token ids, where it states a pad id."""
    found = handed_ids(arguments, IDS)
    if found is None:
        return None
    name, ids = found
    for field, said in ((("src_pad_id" if name in SOURCE else "pad_id"), "the model's pad id"), ("pad_id", "the model's pad id"),
                        ("tokenizer_pad_id", "its tokenizer's pad id")):
        if isinstance(arguments.get(field), int):
            return name, ids, arguments[field], said
    return None


def batch_axis(run: Run) -> list:
    """Calls whose keys are the samples of the model call's padded ids and whose batch rows are their tokens."""
    found, axes = [], {}
    for call in [*run.calls, *run.cross]:
        top = run.top(call)
        if top is None or call.stored is None:
            continue
        if id(top) not in axes:
            axes[id(top)] = None
            given = _ids(top.arguments)
            if given is not None:
                name, ids, pad_id, said = given
                pad = ids == pad_id
                along = _edge(pad), _edge(pad.T)  # (padding runs along the tokens of each row; of each column)
                if name in MAJOR:
                    along = along[0], False  # (named as transformers names them: (batch, seq), whatever their padding)
                if along[0] != along[1] and ids.shape[0] != ids.shape[1] and min(ids.shape) > 1:
                    samples, tokens = ids.shape if along[0] else ids.shape[::-1]
                    if tokens >= 3:  # (two tokens a row: a pad run at one edge of every row says little)
                        axes[id(top)] = (name, samples, tokens, pad_id, said, top.where)
        held = axes[id(top)]
        if held is None:
            found += _fields(call, top) or _loader(call, top)
            continue
        name, samples, tokens, pad_id, said, where = held
        rows, k_len = call.shape[0], call.shape[3]
        if k_len != samples or rows != tokens:
            continue
        found += _across(call, f"the {samples} samples of `{name}` given to {where} (padded with {said} {pad_id} along "
                         f"their {tokens} tokens) and its {rows} batch rows are their tokens",
                         f"attention over each sample's {tokens} tokens", f"{name} given to {where}")
    return found + _run_alone(run)


def _fields(call, top) -> list:
    """A call of a model handed fields of one value per sample (trace/samplefields.py) whose keys are its B samples and
    whose batch rows are not, but as many as a sequence built of each sample's fields holds (its widest field's tokens
    at least, all its fields' at most): its rows are each sample's tokens, its keys the samples."""
    given = top.arguments.get("sample_fields")
    if given is None:
        return []
    names, samples, widths = given
    rows, k_len = call.shape[0], call.shape[3]
    if k_len != samples or rows == samples or rows < 2 or not max(widths) <= rows <= sum(widths):
        return []
    listed = ", ".join(f"`{n}`" for n in names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    one = next(n for n, w in zip(names, widths) if w == 1)
    return _across(call, f"the {samples} samples of the fields given to {top.where} ({listed}: one first axis of "
                   f"{samples}, `{one}` one value per sample) and its {rows} batch rows are a sequence of each sample's "
                   f"fields ({max(widths)} to {sum(widths)} tokens)", f"attention over each sample's {rows} tokens",
                   f"the fields given to {top.where}")


def _loader(call, top) -> list:
    """A call of a model handed a batch a DataLoader collated ((B, T, D): trace/loaderbatch.py) whose keys are its B
    samples and whose batch rows are its T tokens: each token attends the same token of the other samples."""
    given = top.arguments.get("loader_batch")
    if given is None:
        return []
    name, samples, tokens, loader, where = given
    if call.shape[3] != samples or call.shape[0] != tokens:
        return []
    return _across(call, f"the {samples} samples of `{name}` given to {top.where}, a batch that DataLoader `{loader}` "
                   f"(in {where}, batch_size={samples}, its default collate: the samples stacked on the first axis) "
                   f"drew, and its {tokens} batch rows are their {tokens} steps", f"attention over each sample's "
                   f"{tokens} steps", f"DataLoader `{loader}` in {where}")


def _across(call, keys: str, expected: str, source: str) -> list:
    """[(call, batch-axis-attended)] where a query of `call` sees a key other than its own sample's (the diagonal of a
    square call), any head, its keys being `keys`; [] where none does or the mask is not kept."""
    cells = keep(call)
    if cells is None:
        return []
    k_len = call.shape[3]
    seen = np.broadcast_to(cells.any(axis=1), (cells.shape[0], call.shape[2], k_len)).copy()
    if call.shape[2] == k_len:
        seen[:, np.arange(k_len), np.arange(k_len)] = False  # (its own sample's cell: what it should see of itself)
    if not seen.any():
        return []
    b, q, k = first_cell(seen)
    return [(call, Finding("batch-axis-attended", (
        f"attention along the batch: its {k_len} keys are {keys}: token {b} of sample {q} sees token {b} of sample {k}, "
        f"never the other tokens of its own sample (a layer whose batch_first is not the layout it was handed: "
        f"batch_first=False given (batch, seq, embed)?)"), expected=expected, source=source, cell=(b, q, k)))]


def _alone(run: Run) -> list:
    """(batch top, samples, top of one of its samples run alone, which sample) for each model call of B > 1 rows whose
    every tensor argument another call of the same module was handed one row of (the same row of each). The calls of
    one row are looked up by their first argument's row hash (not each batch against every call: a decode loop's
    thousands of steps)."""
    rows = [(at, top, dict(top.rows)) for at, top in enumerate(run.tops) if top.rows]
    single = {}
    for at, other, one in rows:
        if all(len(h) == 1 for h in one.values()):
            first = next(iter(one))
            single.setdefault((other.where, frozenset(one), first, one[first][0]), []).append((at, other, one))
    found = []
    for _, top, held in rows:
        sizes = {len(hashes) for hashes in held.values()}
        if len(sizes) != 1 or min(sizes) < 2:
            continue
        names = frozenset(held)
        candidates = sorted((c for name in held for h in set(held[name])
                             for c in single.get((top.where, names, name, h), ())), key=lambda c: c[0])
        for _, other, one in candidates:
            same = set.intersection(*({i for i, h in enumerate(held[name]) if h == one[name][0]} for name in held))
            if same:
                found.append((top, sizes.pop(), other, min(same)))
                break
    return found


def _run_alone(run: Run) -> list:
    """Calls of a batch whose keys are its samples, where the program runs one of them alone (_alone)."""
    found = []
    for top, samples, other, sample in _alone(run):
        alone, seen = {}, {}
        for call in run.made_by(other):
            alone.setdefault(call.where, []).append(call.shape)
        for call in run.made_by(top):  # (each call against the site's call of the same turn in the run alone: a loop
            rows, k_len = call.shape[0], call.shape[3]  # whose keys grow, a beam search re-running its prefix, has
            turn = seen[call.where] = seen.get(call.where, -1) + 1  # 1 key at its first turn, 4 at its fourth)
            there = alone[call.where][turn] if turn < len(alone.get(call.where, ())) else None
            if k_len != samples or rows == samples or rows < 2 or there is None or there[3] != 1 or there[0] != rows:
                continue  # (one batch row alone: a sequence-first pass of one column, its first step run alone, has 1 key
                # and 1 row too; a sample's tokens as the rows need two to say so: pytorch/examples' word LM)
            found += _across(call, f"the {samples} samples given to {top.where} (the program runs sample {sample} "
                             f"alone, every tensor argument one row of the batch's, and there this site has 1 key and "
                             f"the same {rows} batch rows)", "attention over each sample's own tokens, as in its run "
                             "alone", f"{top.where} run on sample {sample} alone")
    return found


RULES = (
    Rule("batch-axis-attended", "wrong", "call", "a call whose keys are the samples of the model call's padded token ids and "
         "whose batch rows are their tokens: attention across the batch, each sample never seeing its own other tokens "
         "(batch_first=False handed (batch, seq, embed))", batch_axis),
)
