"""A transformers model the program subclassed and named bidirectional, run causal (bidirectional-run-causal).

An embedding or set model built on a decoder states its attention both ways in the name of the subclass it writes
(`LlamaBidirectionalModel`, NV-Embed's `BidirectionalMistralModel`, LLM2Vec's `LlamaBiModel`: checks/causalname.
both_class), and turns the decoder's causal mask off by overriding what builds it. When the library stops calling the
override (ArcInstitute/state#227: LlamaModel builds its mask with masking_utils.create_causal_mask, not
`_update_causal_mask`), the model runs causal and nothing says so. Said where every square call under the class is
causal (no query sees a later key, whatever the padding); quiet where any call under it attends both ways
(a model that runs both, an embedding pass beside generation), and on a cache's steps.
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import Run, keep
from maskcli.text import Finding


def _causal(cells) -> bool:
    """No query sees a later key, and some query sees two keys or more (a padded row's queries past its end see its
    real keys only: read as they are, whatever side the padding is on)."""
    return cells is not None and not np.triu(cells, 1).any() and bool((cells.sum(axis=-1) > 1).any())


def named_both(run: Run) -> list:
    """Square calls under a program's transformers subclass named bidirectional, all of them causal."""
    under: dict = {}
    for call in [*run.calls, *run.unmasked]:
        if call.details.get("class_both"):
            under.setdefault(call.details["class_both"], []).append(call)
    found = []
    for name, calls in under.items():
        square = [call for call in calls if call.shape[2] == call.shape[3] > 1]
        cells = [keep(call) for call in square]
        if not square or len(square) < len(calls) or not all(_causal(c) for c in cells):
            continue
        call = square[0]
        found.append((call, Finding("bidirectional-run-causal", (
            f"{call.where} (call {call.index}) is run causal, as are all {len(square)} calls under {name}, though the "
            f"program named the transformers model it subclassed bidirectional: each token should see the later ones "
            f"too (the library still builds its causal mask: an override it no longer calls, or an is_causal flag it does not read?)"),
            expected="full", source=f"the class name {name}", cell=(0, 0, 0, 1))))
    return found
