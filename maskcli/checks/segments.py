"""A padded batch attended one sequence at a time, in pieces that are not its rows' real tokens.

A variable-length kernel (flash-attn's `flash_attn_varlen_func`, or a loop of one attention per sequence standing for
it) is handed the batch unpadded: each row's real tokens, packed, with cumulative lengths read off the padding
(transformers' `_upad_input` / `_get_unpad_data`). Each call of one batch row then attends over exactly that row's
real tokens, so one model call makes, at a self-attention site, one call per batch row whose lengths are the
padding's. Where the program holds that padding (trace/held.py: the 2-D `attention_mask` of a function on the
stack, or its lengths) and the site's per-sequence calls are shorter than a row's real tokens, the unpadding read
another mask: Whisper's FlashAttention-2 path sliced the (B, L) mask to `key_states.shape[-2]` = num_heads columns
(transformers#36477), so the segments are cut from the wrong tokens with the wrong boundaries.

Stays quiet where the calls are as long as the rows' real tokens or longer (a loop over the padded rows whole, which
causal attention makes harmless on right padding), where their number is not the batch's, and where the padding is
not a padded batch's (every row real, a hole in a row).

The same bug read from the other side: a varlen call's documents (details["documents"], the cu_seqlens its frames or
modules hold) that cover fewer tokens than the model call states real for the (B, L) batch the call's layer was handed
(details["query_input"]; checks/real.stated: its mask, lengths or pad id, said outright). `pad_input` leaves the tokens
past the documents zero: they attend nothing. hao-ai-lab/FastVideo cceacec99 (written blind, batch blind-kk): MMAudio's
CLIP text encoder handed OpenCLIP's additive causal mask (1, 1, S, S) to the FLASH_ATTN backend, which read its first
query row as a key padding mask (`>= 0`: one key), so the varlen kernel ran over one token of the first prompt. Quiet
where the documents cover every real token (packed, unpadded), where the layer was handed another shape than the model
call's ids (a decode step, a pruned sequence), and where the padding is only guessed.

And the bug the other way round: the documents cover the padding. A model call handed the batch flattened onto one
token axis (THD: `input_ids` and `attention_mask` of (B·L,)) states which of those tokens are padding; a varlen call's
documents (its cu_seqlens, over as many tokens) that hold padding let the document's real queries attend it, wherever
the kernel does not hide it (not causal, or the padding before them). prescient-design/lobster#105 (written blind, batch
blind-la): UME's flash path counted every row at its padded length (`cu_seqlens = [0, L, 2L, ...]`), so each protein's
residues attended its own pads. Read from the calls themselves (a varlen call over all the tokens, or one call per
document in order): quiet where the documents hold no padding (unpadded first, the fix), where only padding queries see
it, and where the model call states no flat mask of the documents' length.
"""

from __future__ import annotations

import numpy as np

from types import SimpleNamespace

from maskcli.checks.context import Run, keep
from maskcli.checks.held import readings
from maskcli.checks.real import stated
from maskcli.checks.reqlens import one_sequence
from maskcli.checks.registry import Rule
from maskcli.text import Finding


def cut_segments(run: Run) -> list:
    """Per-sequence self-attention calls of one model call shorter than the real tokens of the rows the program's
    held padding gives, row by row."""
    found = []
    for top in run.tops:
        sites: dict = {}
        for call in run.made_by(top):
            if one_sequence(call, alike=False) and call.shape[2] == call.shape[3] and run.top(call) is top:
                sites.setdefault(call.where, []).append(call)
        for calls in sites.values():
            finding = _finding(calls, top)
            if finding is not None:
                found.extend((call, finding) for call in calls)
    return found + uncovered(run, {call.index for call, _ in found})


def _finding(calls: list, top) -> Finding | None:
    if len(calls) < 2:
        return None
    pieces = [int(call.shape[2]) for call in calls]
    helds = {id(h["rows"]): h for call in calls for h in call.details.get("held_padding") or ()}
    if any(getattr(h["rows"], "ndim", 0) == 2 and h["rows"].shape[0] == 1 and {h["rows"].shape[1]} == set(pieces)
           for h in helds.values()):
        return None  # (the frames hold one sequence of the calls' length: they are its layers, not rows one at a time)
    for held in helds.values():
        if held["kind"] not in ("keep", "pad", "lengths") or getattr(held["rows"], "ndim", 0) < 1:
            continue
        rows = held["rows"].shape[0]
        length = int(held["rows"].max()) if held["kind"] == "lengths" else held["rows"].shape[-1]
        given = calls[0].details.get("query_input")
        if calls[0].shape[0] > 1 and (not given or tuple(given[:2]) != (rows, length)):
            continue  # (heads on the batch axis: only the padding of the (B, L) batch its layer was handed, not a
            # caption's lengths beside an image's tokens run one at a time, Lumina-Next's reference loop)
        if not any(shape and shape[0] == rows for _, shape in top.shapes):
            continue  # (the model call was handed no tensor of the batch's rows: a reference run of one sequence,
            # whose layers a loop calls one by one, not the batch's rows one at a time: gpt-neox's, quiet-r165b)
        tables = readings(held, rows, length) if rows == len(calls) else []
        if not tables:
            continue
        real = [int(n) for n in tables[0].sum(axis=1)]  # (each reading has the same count per row)
        cut = [b for b in range(rows) if pieces[b] < real[b]]
        if not cut:
            continue
        b = cut[0]
        said = f"{held['name']} in {held['where']}"
        return Finding("segments-cut", (
            f"{len(calls)} calls attend one sequence each, over {pieces} tokens, but {said} gives the batch's rows "
            f"{real} real tokens: batch row {b}'s {real[b]} are cut to {pieces[b]} — the unpadding (indices, "
            f"cu_seqlens) was read off another mask, sliced or shaped wrong?"),
            expected=f"one call per row over its real tokens: {real}", source=said, cell=(b, pieces[b], pieces[b]))
    return None


CUMULATIVE = ("cu_seqlens", "cu_seq_lens_q", "cu_seqlens_q")


def _covered(documents: dict) -> tuple[str, np.ndarray] | None:
    """(name, cumulative lengths) of the query side's documents, where they are a well-formed run from 0."""
    for name in CUMULATIVE:
        cu = documents.get(name)
        if isinstance(cu, np.ndarray) and cu.ndim == 1 and len(cu) > 1 and cu[0] == 0 and (np.diff(cu) >= 0).all():
            return name, cu
    return None


def _shown(cu: np.ndarray) -> str:
    """Cumulative lengths as a list, its first 8 shown."""
    return f"{cu.tolist()[:8]}{'...' if len(cu) > 8 else ''}"


def _lengths(cu: np.ndarray) -> str:
    lengths = [int(x) for x in np.diff(cu)]
    return ", ".join(map(str, lengths[:6])) + (", ..." if len(lengths) > 6 else "")


def uncovered(run: Run, done_calls: set) -> list:
    """Varlen calls whose documents cover fewer tokens than the real ones the model call states for the batch their
    layer was handed (calls cut_segments found already left out)."""
    found, done = [], set()
    for call in run.calls:
        documents, given = call.details.get("documents"), call.details.get("query_input")
        if not documents or not given or call.index in done_calls or (covered := _covered(documents)) is None:
            continue
        top = run.top(call)
        rows, length = int(given[0]), int(given[1])
        said = stated(top, rows, length)
        if said is None or not said[2]:
            said = _held_lengths(call, rows, length)  # (the batch's lengths a frame holds: TransformerEngine#818)
            if said is None:
                continue
        name, cu = covered
        key = (id(top), name, cu.tobytes())
        real = np.broadcast_to(said[0], (rows, length))
        if key in done or int(cu[-1]) >= int(real.sum()):
            continue
        done.add(key)
        per_row = [int(x) for x in real.sum(axis=1)]
        ran = int(cu[-1])
        b, q = (int(x) for x in np.argwhere(real)[ran])  # (the first real token past those the documents cover)
        found.append((call, Finding("segments-cut", (
            f"the varlen kernel at {call.where} ran over {ran} token{'s' if ran != 1 else ''} ({name} {_shown(cu)}: "
            f"documents of {_lengths(cu)}), but the batch of {rows} rows it was handed "
            f"holds {int(real.sum())} real tokens ({', '.join(map(str, per_row))} a row, by {said[1]}): "
            f"{int(real.sum()) - ran} real tokens attend nothing, their attention output left zero (query {q} of batch "
            f"row {b} among them); "
            + ("each document as long as its row's padding: the padding mask read the wrong way round (True = padding "
               "counted as tokens)" if _inverted(cu, real) else
               "build the lengths from the batch's padding mask, not from another mask")),
            expected=f"documents covering the {int(real.sum())} real tokens ({', '.join(map(str, per_row))} a row)",
            source=f"{name} at {call.where}, and {said[1]}", cell=(b, q, 0))))
    return found


def _held_lengths(call, rows: int, length: int) -> tuple[np.ndarray, str, bool] | None:
    """(bool (rows, length) real tokens, where it is said, True) of the batch's lengths a frame on the stack holds
    (trace/held.py), laid at the side the ids it holds beside them pad (right where none says); None where no frame
    holds lengths of this batch."""
    helds = call.details.get("held_padding") or ()
    ids = [held["rows"] for held in helds if held["kind"] == "ids" and np.shape(held["rows"]) == (rows, length)]
    for held in helds:
        tables = readings(held, rows, length) if held["kind"] == "lengths" else []
        if tables:
            side = next((t for t in tables for given in ids if len(np.unique(given[~t])) == 1), tables[0])
            return side, f"{held['name']} in {held['where']}", True
    return None


def _inverted(cu: np.ndarray, real: np.ndarray) -> bool:
    """Documents one a row, each as long as its row's padding (lengths read off the padding mask's other polarity)."""
    lengths = np.diff(cu)
    return len(lengths) == real.shape[0] and bool((lengths == (~real).sum(axis=1)).all())


def _flat(top, total: int) -> tuple[np.ndarray, str] | None:
    """(bool (total,) real tokens, the argument that says it) a model call states over a flat token axis of `total`
    tokens (its 1-D masks or ids, read as one row by checks/real.stated), outright only; None where it states none."""
    flat = set() if top is None else {name for name, value in top.arguments.items()
                                      if isinstance(value, np.ndarray) and value.shape == (total,)}
    if not flat:
        return None
    arguments = {name: value.reshape(1, -1) if name in flat else value for name, value in top.arguments.items()}
    said = stated(SimpleNamespace(arguments=arguments, where=top.where), 1, total)
    return (said[0].reshape(-1), said[1]) if said is not None and said[2] else None


def _spans(calls: list, cu: np.ndarray) -> list:
    """(call, first token) of a site's calls in one model call laid over the documents: one call over all the tokens,
    or one per document in their order (per layer pass); [] where they lie otherwise."""
    total, lengths = int(cu[-1]), [int(x) for x in np.diff(cu)]
    if all(call.shape[2] == call.shape[3] == total for call in calls):
        return [(call, 0) for call in calls]
    if len(calls) % len(lengths) or any(call.shape[2] != call.shape[3] or call.shape[2] != lengths[i % len(lengths)]
                                        for i, call in enumerate(calls)):
        return []
    return [(call, int(cu[i % len(lengths)])) for i, call in enumerate(calls)]


def padded_documents(run: Run) -> list:
    """Varlen calls (or one call per document) whose real queries see keys the model call states are padding on the
    flat token axis the documents cut."""
    found, sites = [], {}
    for call in run.calls:
        documents = call.details.get("documents")
        if documents and (covered := _covered(documents)) is not None \
                and call.details.get("documents_over", int(covered[1][-1])) == int(covered[1][-1]):
            sites.setdefault((id(run.top(call)), call.where, covered[0]), []).append(call)
    done = set()
    for (_, where, name), calls in sites.items():
        cu = calls[0].details["documents"][name]
        said = _flat(run.top(calls[0]), int(cu[-1])) if where not in done else None
        if said is None or said[0].all():
            continue
        real = said[0]
        for call, start in _spans(calls, cu):
            cells = keep(call)
            if cells is None:
                continue
            span = real[start:start + call.shape[3]]
            bad = cells.any(axis=(0, 1)) & span[:, None] & ~span[None, :]
            if not bad.any():
                continue
            q, k = (int(x) for x in np.argwhere(bad)[0])
            doc = int(np.searchsorted(cu, start + q, side="right")) - 1
            pads = int((~real[int(cu[doc]):int(cu[doc + 1])]).sum())
            done.add(where)
            found.append((call, Finding("documents-span-padding", (
                f"document {doc} of {name} {_shown(cu)} holds {pads} tokens that "
                f"{said[1]} states are padding, and its real token {start + q} attends "
                f"padding token {start + k}: a varlen kernel attends every token of a document, so the lengths must be "
                f"the real tokens' (unpad the batch first, as flash-attn's unpad_input does), not the padded rows'"),
                expected="documents over the real tokens only", source=f"{name} at {where}, and {said[1]}",
                cell=(0, q, k))))
            break
    return found


RULES = (
    Rule("segments-cut", "wrong", "steps", "a padded batch attended one sequence per call (a varlen kernel's segments) "
         "over fewer tokens than the padding the program holds gives its rows: the unpadding read another mask "
         "(Whisper's FA2 path sliced to num_heads columns), or documents that cover fewer tokens than the model call "
         "states real", cut_segments),
    Rule("documents-span-padding", "wrong", "call", "a varlen call's documents (cu_seqlens) hold tokens the model call "
         "states are padding on its flat token axis, and real queries attend them (lobster#105: every row counted at "
         "its padded length)", padded_documents),
)
