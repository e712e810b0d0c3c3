"""Documents stated over the model call's token ids, handed to a layer that attends over more tokens than that.

A packed batch's boundaries (`cu_seqlens`, Megatron's `PackedSeqParams.cu_seqlens_q / cu_seqlens_kv`) count the
tokens they were made over. A vision-language model expands its ids inside its forward (each image placeholder into
`img_seq_len` image embeddings: LLaVA's `_preprocess_data`), so the boundaries must be mapped through the same
expansion before the language model's varlen attention reads them (Megatron-LM#3427: they were not; the tail of
one sample was attended as part of the next, and the last tokens fell outside every sub-sequence).

Read from what trace records of the innermost module handed the documents (trace/packed.py `handed`: by keyword or
in an argument object, and how many tokens its hidden states hold). Said where the boundaries end exactly at the
model call's own token count (B x L ids: they are the ids' boundaries) while that module attends over more tokens:
the expansion happened after they were made, and no token past their end is in any document. Quiet where they end at
the module's own token count (remapped, or no expansion), where they end elsewhere than at the ids' count (a tail
padded for alignment, documents over another tensor), and on query and key boundaries that differ.
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import Run
from maskcli.checks.real import TOKENS
from maskcli.checks.registry import Rule
from maskcli.text import Finding

SHOWN = 6  # boundaries a message lists


def _boundaries(documents: dict) -> tuple[str, np.ndarray] | None:
    """(name, cumulative lengths) of self-attention documents: q's, where the keys' are the same."""
    for name, other in (("cu_seqlens_q", ("cu_seqlens_kv", "cu_seqlens_k")), ("cu_seqlens", ()),
                        ("cu_seq_lens_q", ("cu_seq_lens_k",))):
        cu = documents.get(name)
        if cu is None:
            continue
        cu = np.asarray(cu).reshape(-1)
        keys = next((documents[n] for n in other if documents.get(n) is not None), cu)
        if len(cu) < 2 or not np.array_equal(cu, np.asarray(keys).reshape(-1)) or (np.diff(cu) < 0).any():
            return None
        return name, cu
    return None


def unexpanded(run: Run) -> list:
    """A module handed documents that end at the model call's token count, attending over more tokens."""
    found, done = [], set()
    for call in run.calls:
        over = call.details.get("documents_over")
        said = call.details.get("documents")
        top = run.top(call)
        if not isinstance(over, int) or not isinstance(said, dict) or top is None:
            continue
        held = _boundaries(said)
        ids = next((top.arguments[n] for n in TOKENS if isinstance(top.arguments.get(n), np.ndarray)), None)
        if held is None or ids is None or ids.ndim != 2:
            continue
        name, cu = held
        if int(cu[-1]) != ids.size or over <= ids.size:
            continue
        key = (id(top), cu.tobytes(), over)  # (said once per model call: every layer is handed the same)
        if key in done:
            continue
        done.add(key)
        found.append((call, Finding("documents-unexpanded", (
            f"{name} handed to {call.where} end at {int(cu[-1])}, the {ids.size} token ids of the model call "
            f"{top.where}, but it attends over {over} tokens (expanded inside the model after the boundaries were "
            f"made): tokens {ids.size}-{over - 1} are in no document, and the boundaries {cu.tolist()[:SHOWN]} count "
            f"the ids, not the tokens attended"),
            expected=f"{name} mapped through the expansion, ending at {over}",
            source=f"{name} handed to {call.where}")))
    return found


RULES = (
    Rule("documents-unexpanded", "wrong", "steps", "packed-document boundaries (cu_seqlens) made over the model call's "
         "token ids, handed to a layer that attends over more tokens (ids expanded inside the model)", unexpanded),
)
