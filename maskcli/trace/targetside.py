"""A seq2seq's target side among the arguments of a model call: `forward(source_token_ids, target_token_ids)`.

A hand-written encoder-decoder takes its source ids first and its target ids beside them; its first ids are then the
source's, and neither its decoder's self-attention nor its output (the target's positions) is stated by them
(checks/real.py, trace/poolrows.py). Told by the name of another parameter handed integer ids: `tgt...`, `trg...`,
`target...`, `decoder_...` (toynlp's `target_token_ids`).
"""

from __future__ import annotations

import re

import torch

TARGET_SIDE = re.compile(r"(?:decoder_|tgt|trg|target)")


def beside(names, given: dict, first: str) -> str | None:
    """The first of `names` other than `first` that names a target side and was handed integer ids; else None."""
    return next((n for n in names if n != first and TARGET_SIDE.match(n) and issubclass(type(given.get(n)), torch.Tensor)
                 and not given[n].is_floating_point()), None)
