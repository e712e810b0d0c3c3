"""The positions a model reads its table of learned absolute positions at, as each of its calls ran.

A model with a table of absolute positions (GPT-2's `wpe`, OPT's and BART's `embed_positions`, BERT's
`position_embeddings`: an nn.Embedding of as many rows as the positions its config allows) places each token by
the row it reads there, whatever the program handed it: position_ids, or none (the model counts them itself, from
0 or from the attention_mask, as each family does). A reader of `F.embedding` (it records no call) keeps, per
table, the indices of its last lookup; when the model call is finished (outer.py), its Top gets them as
`table_positions` (B or 1, L), the row offset (BART's 2) left in: checks/aloneplaces.py compares two calls of the same
model. A model with more than one table (an encoder's and a decoder's) states none: which one a call read is not
known here.
"""

from __future__ import annotations

import re
import weakref

import numpy as np
import torch
import torch.nn.functional as F

from maskcli.trace.losses import watched as losses
from maskcli.trace.sinusoid import taken

NAMES = re.compile(r"^_*(?:wpe|embed_positions|position_embeddings?|positional_embeddings?|pos_emb(?:ed|edding|eddings)?"
                   r"|pos_embeddings?)$")
LIMITS = ("max_position_embeddings", "n_positions", "max_positions", "n_ctx")
MOST = 1 << 16  # indices of one lookup kept (copied at every lookup of every table: the token embedding's too)
_TABLES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def watched(trace) -> dict:
    """The readers of what the program states, recording no call: its loss's (trace/losses.py) and F.embedding's, the
    indices of each lookup by the table it reads (its weight), for this thread."""
    def embedding(args, kwargs):
        index = args[0] if args else kwargs.get("input")
        weight = args[1] if len(args) > 1 else kwargs.get("weight")
        if isinstance(index, torch.Tensor) and isinstance(weight, torch.Tensor) and index.dim() in (1, 2) \
                and not index.is_floating_point() and 0 < index.numel() <= MOST and index.device.type != "meta":
            # (an empty lookup reads no row: `special(toks[special_mask])` where no token is special, WhisperSpeech's)
            held = trace._local.__dict__.setdefault("tables", {})
            held[id(weight)] = index.detach().cpu().numpy().astype(np.int64).reshape(-1, index.shape[-1])
        return None

    embedding.api, embedding.records = "embedding", False
    return {**losses(trace), F.embedding: embedding}


def table(module) -> torch.Tensor | None:
    """The weight of the model's one table of absolute positions, by its name or the name of the module that holds it
    (x-transformers' `pos_emb.emb`: an AbsolutePositionalEmbedding around its nn.Embedding) or its rows (the positions
    its config allows, or 2 more: OPT's, BART's offset) and not the vocabulary's; None with none or more than one.
    Read once."""
    try:
        return _TABLES[module]()
    except (KeyError, TypeError):
        pass
    config = getattr(module, "config", None)
    limits = {v for v in (getattr(config, n, None) for n in LIMITS) if isinstance(v, int) and v > 0}
    vocab = getattr(config, "vocab_size", None)
    try:  # (the token embedding, of as many rows as positions only by chance)
        tokens = module.get_input_embeddings()
    except Exception:  # noqa: BLE001 - a model without one, or one that cannot say: told apart by its rows alone
        tokens = None
    found = [each.weight for name, each in module.named_modules() if isinstance(each, torch.nn.Embedding)
             and "relative" not in name and each is not tokens
             and (any(NAMES.match(part) for part in name.split(".")[-2:]) or each.num_embeddings != vocab
                  and each.num_embeddings in {*limits, *(v + 2 for v in limits)})]
    weight = found[0] if len(found) == 1 else None
    try:
        _TABLES[module] = (lambda: weight) if weight is None else weakref.ref(weight)
    except TypeError:
        pass
    return weight


def table_positions(module, local) -> dict:
    """{"table_positions": the indices the model's table was last read at, "table_padding_row": the table's padding_idx
    where it keeps one} of the call just finished, taken from what the reader kept for this thread (each lookup read
    once: the next call of the model reads its own)."""
    held = local.__dict__.get("tables")
    try:
        weight = table(module) if held else None
    except Exception:  # noqa: BLE001 - a program's module that cannot be walked: no table read
        return {}
    found = None if weight is None else held.pop(id(weight), None)
    encoded = taken(held) if held else None  # (a sinusoidal encoding added: sinusoid.py; a learned table first)
    if found is None:
        return {} if encoded is None else {"table_positions": encoded}
    row = next((each.padding_idx for each in module.modules() if isinstance(each, torch.nn.Embedding)
                and each.weight is weight), None)  # (its padding row: SASRec's pads take position 0, a zero row)
    return {"table_positions": found, **({} if row is None else {"table_padding_row": int(row)})}
