"""Boundaries inside each batch row, judged on its real tokens: a chunked layer's chunks and EOS-delimited documents.

Both are read per batch row and per query position, after the padding (checks/real.py) and the cache
offset (the query positions) are resolved, so a mask that holds unpadded is judged the same left-padded:

- **chunks-misplaced**: a layer the config makes chunked (`attention_chunk_size`, Llama 4) counts its chunks
  from each row's first real token, as transformers does (masking_utils.py chunked_overlay: `(kv_idx -
  left_padding) // chunk_size == (q_idx - left_padding) // chunk_size`). A mask that chunks (some real query
  misses an earlier key of its own document) with its chunks elsewhere — counted from column 0 of a
  left-padded row, or from a decode step's own count — is wrong. Plain causal is config.py's chunks-missing;
  a key of another packed document (position_ids restarting) is arguments.py's documents-leak.
- **eos-documents-leak**: documents delimited by the EOS id in the model call's input ids (the config's
  `eos_token_id`, or the model's own `eos_id`). Many models attend across EOS on purpose (GPT-2's
  pretraining), so a mask is judged only where some mask of the run cuts, and only beside an EOS (the program's own
  word that EOS ends a document: a chunked layer's cuts fall elsewhere too); then a real query that sees a key with an EOS strictly between them is wrong, however
  the program's convention places the EOS itself (ending its document, or starting the next). A run of EOS ids ends
  one document (a pad id that is the EOS id pads a packed row with them: prime-rl's pad run, one block of its own).
"""

from __future__ import annotations

import re

import numpy as np

from maskcli.checks.arguments import document_starts
from maskcli.checks.config import layer_kind
from maskcli.checks.context import Run, columns_are_positions, first_cell, keep, layer, queries
from maskcli.checks.real import TOKENS, Real, behind_cache, by_row, resolve
from maskcli.checks.configread import text_part
from maskcli.checks.registry import Rule
from maskcli.text import Finding


def _documents(top, rows: int, k_len: int) -> np.ndarray:
    """Int64 (rows, Lk): each key's packed document by the model call's position_ids restarting at 0 (all 0 without)."""
    positions = None if top is None else top.arguments.get("position_ids")
    if isinstance(positions, np.ndarray) and positions.ndim == 2 and positions.shape[1] == k_len \
            and positions.shape[0] in (1, rows):
        return np.broadcast_to(document_starts(positions, None), (rows, k_len))
    return np.zeros((rows, k_len), dtype=np.int64)


def _index(call, config) -> int | None:
    """The call's layer; 0 for a call with no layer number where every layer is of one kind (a one-layer model)."""
    index = layer(call)
    types = getattr(config, "layer_types", None)
    if index is None and (not isinstance(types, (list, tuple)) or len(set(types)) == 1):
        return 0
    return index


def _by_positions(top, own: np.ndarray, seen: np.ndarray, judged: np.ndarray, size: int) -> bool:
    """The mask is chunked by the model call's position_ids (position // size), restarting with each packed document:
    the other way a correct program counts its chunks."""
    positions = None if top is None else top.arguments.get("position_ids")
    rows, q_len, k_len = seen.shape
    if not isinstance(positions, np.ndarray) or positions.ndim != 2 or positions.shape[1] != k_len \
            or positions.shape[0] not in (1, rows) or not ((own >= 0) & (own < k_len)).all():
        return False
    chunk = np.broadcast_to(positions // size, (rows, k_len))
    same = chunk[:, own][:, :, None] == chunk[:, None, :]
    return not (judged & (seen != same)).any()


def chunks(run: Run) -> list:
    """A chunked layer whose chunks do not start at multiples of attention_chunk_size from each row's first real token."""
    found, done = [], set()
    if not any(getattr(text_part(top.config), "attention_chunk_size", None) for top in run.tops):
        return found  # no chunked config (most runs stop here)
    for call in run.calls:
        config = text_part(run.config(call))
        kind = layer_kind(config, _index(call, config))
        size = getattr(config, "attention_chunk_size", None)
        if kind is None or kind[0] != "chunked_attention" or not isinstance(size, int) or size <= 0 \
                or call.stored is None or call.mask in done:
            continue
        top = run.top(call)
        if not columns_are_positions(call, top):
            continue
        done.add(call.mask)
        cells = keep(call)
        if cells is None:
            continue
        rows, _, q_len, k_len = max(cells.shape[0], call.shape[0]), *call.shape[1:]
        seen = by_row(cells, rows)
        own = queries(call, top)
        real = resolve(call, top, seen)
        carried = None if real.source is not None else behind_cache(run, call)
        if carried is not None and carried.shape[0] in (1, rows):  # (the padding its prefill showed: real.py)
            carried = np.broadcast_to(carried, (rows, k_len))
            inside = (own >= 0) & (own < k_len)
            mine = np.zeros((rows, q_len), dtype=bool)
            mine[:, inside] = carried[:, own[inside]]
            real = Real(carried, mine, None)
        keys = np.arange(k_len)
        start = real.keys.argmax(axis=-1)[:, None]  # (B, 1): each row's first real key
        q_chunk, k_chunk = (own[None, :] - start) // size, (keys[None, :] - start) // size
        documents = _documents(top, rows, k_len)
        inside = (own >= 0) & (own < k_len)
        q_doc = np.full((rows, q_len), -1, dtype=np.int64)
        q_doc[:, inside] = documents[:, own[inside]]
        judged = real.queries[:, :, None] & real.keys[:, None, :] & (keys[None, None, :] <= own[None, :, None]) \
            & (q_doc[:, :, None] == documents[:, None, :])
        same = q_chunk[:, :, None] == k_chunk[:, None, :]
        leak, miss = judged & seen & ~same, judged & ~seen & same
        if not (judged & ~seen).any() or not (leak | miss).any() or _by_positions(top, own, seen, judged, size):
            continue  # not chunked at all (chunks-missing's), or chunked where it should be
        b, q, k = first_cell(leak if leak.any() else miss)
        pad = int(start[b, 0])
        what = "sees key {k} of another chunk" if leak.any() else "misses key {k} of its own chunk"
        counted = f"from its first real token ({pad})" if pad else "from position 0"
        sure = real.sure or pad == 0 or real.source is not None
        found.append((call, Finding("chunks-misplaced", (
            f"layer {_index(call, config)} is chunked ({kind[1]}): batch row {b}'s chunks of {size} count {counted}, but query "
            f"{int(own[q])} {what.format(k=k)} ({int((leak | miss).sum())} such cells)"
            + ("" if sure else f" (if keys 0-{pad - 1} of that row are padding, as no real query of it sees them)")),
            None if sure else "suspicious", expected=f"chunks of {size} from each row's first real token",
            source=f"config ({kind[1]})" + (f"; padding from the {real.source}" if real.source else ""),
            cell=(b, int(own[q]), k))))
    return found


def _eos(top, tokens: np.ndarray):
    """(EOS id(s), where said) the input ids are split at: the model's own `eos_id`; where that occurs nowhere in them,
    the EOS of the tokenizer the program tokenized them with, if it differs (trace/tokenizer.py: a model whose
    eos_id was never synced from its tokenizer splits on an id the data does not hold: torchtitan#1144)."""
    own, data = top.arguments.get("eos_id"), top.arguments.get("tokenizer_eos_id")
    if own is not None and np.isin(tokens, np.atleast_1d(own)).any() or data is None or data == own:
        return (None, "") if own is None else (own, "")
    said = f"the EOS of {top.arguments.get('tokenizer', 'the tokenizer')}"
    return data, said + ("" if own is None else f"; the model's eos_id {own} occurs nowhere in them")


def _separators(top, rows: int, k_len: int) -> tuple[np.ndarray, object, str] | None:
    """(bool (rows, Lk) the model call's input ids at its EOS id, that id, where it was said: "" for the model's own);
    None where it gives neither."""
    tokens = None if top is None else next((top.arguments[n] for n in TOKENS if isinstance(top.arguments.get(n), np.ndarray)), None)
    if tokens is None or tokens.ndim != 2 or tokens.shape[1] != k_len or tokens.shape[0] not in (1, rows):
        return None
    eos, said = _eos(top, tokens)
    if eos is None:
        return None
    found = np.broadcast_to(np.isin(tokens, np.atleast_1d(eos)), (rows, k_len))
    return (found, eos, said) if found.any() else None


DOCUMENT_TYPE = re.compile(r"block_?causal|document", re.IGNORECASE)  # torchtitan's attn_mask_type="block_causal"


def _document_word(call) -> str | None:
    """The attending module's own mask type where it names a document mask (trace/sites.py: 'FlexAttention.attn_mask_type
    =block_causal', torchtitan's word for causal within the documents its input ids' EOS ends): the program's statement
    that the mask restarts at each EOS, where no mask of the run shows it."""
    said = call.details.get("module_causal") or ""
    return said if "=" in said and DOCUMENT_TYPE.search(said.split("=", 1)[1]) else None


def _restarts_at(seen: np.ndarray, real, separators: np.ndarray) -> bool:
    """Some batch row's mask cuts (query t+1 does not see key t-1, both real, though it sees itself), and only beside an EOS
    (at t-1, t or t+1: the EOS ending its document or starting the next): a document mask by the EOS, not a chunked
    layer's or a window's cuts that may fall beside one by chance."""
    rows, length = separators.shape
    if length < 3:
        return False
    t = np.arange(1, length - 1)
    both = real.queries[:, t + 1] & real.keys[:, t - 1]
    cuts = both & ~seen[:, t + 1, t - 1] & seen[:, t + 1, t + 1]  # (B, L-2)
    beside = separators[:, t - 1] | separators[:, t] | separators[:, t + 1]
    return bool((cuts.any(axis=1) & ~(cuts & ~beside).any(axis=1)).any())  # (a row that does: a wrong row may not)


def eos_documents(run: Run) -> list:
    """Real queries that see a key across an EOS, in a run whose masks restart at some EOS."""
    judged, restarts = [], None
    if not any(("eos_id" in top.arguments or "tokenizer_eos_id" in top.arguments) and any(n in top.arguments for n in TOKENS)
               for top in run.tops):
        return []  # no model call states EOS-delimited input ids (most runs stop here)
    for call in run.calls:
        top = run.top(call)
        q_len, k_len = call.shape[2:]
        if call.stored is None or q_len != k_len or q_len < 3 or not columns_are_positions(call, top):
            continue
        rows = call.shape[0]
        held = _separators(top, rows, k_len)
        cells = None if held is None else keep(call)
        if cells is None or cells.shape[0] not in (1, rows):
            continue
        separators, eos, said = held
        seen = by_row(cells, rows)
        real = resolve(call, top, seen)
        first = separators.copy()  # (a run of EOS ends one document: pad = eos, a pad run counting on after a sample's
        first[:, 1:] &= ~separators[:, :-1]  # EOS, is no run of empty documents, prime-rl's packed GRPO rows)
        count = np.cumsum(first, axis=1)  # EOS runs begun at or before each position
        before = np.concatenate([np.zeros((rows, 1), np.int64), count[:, :-1]], axis=1)  # EOS strictly before
        keys = np.arange(k_len)
        across = (before[:, :, None] - count[:, None, :] > 0) & (keys[None, None, :] < keys[None, :, None])
        across &= real.queries[:, :, None] & real.keys[:, None, :]
        if restarts is None and _restarts_at(seen, real, separators):
            restarts = "the mask restarts its documents at an EOS (id {eos}) elsewhere"
        word = _document_word(call)
        if restarts is None and word is not None:
            restarts = f"{word} states a document mask (each EOS ends a document; the input ids' EOS: id {{eos}})"
        judged.append((call, top, seen, across, eos, said))
    if restarts is None:
        return []
    found, done = [], set()
    for call, top, seen, across, eos, said in judged:
        leak = seen & across
        if not leak.any() or call.mask in done:
            continue
        done.add(call.mask)
        b, q, k = first_cell(leak)
        found.append((call, Finding("eos-documents-leak", (
            f"{restarts.replace('{eos}', str(eos))}{f' ({said})' if said else ''}, but query {q} of batch row {b} sees key {k} "
            f"across an EOS ({int(leak.sum())} such cells): that document's boundary is lost"),
            expected="a document mask from the EOS in the input ids",
            source=f"input ids of {top.where} at " + (said.split(";")[0] if said else "their EOS id"), cell=(b, q, k))))
    return found


RULES = (
    Rule("chunks-misplaced", "wrong", "steps", "a chunked layer (attention_chunk_size) whose chunks are not counted from "
         "each batch row's first real token (chunks counted from column 0 of a left-padded row)", chunks),
    Rule("eos-documents-leak", "wrong", "steps", "a mask that restarts its documents at an EOS in the input ids at some "
         "EOS and lets a query see across another", eos_documents),
)
