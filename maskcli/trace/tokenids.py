"""The ids a model states of its tokens (pad, eos, each side's pad, a media token): read once per model for its Tops
(tops.py), from its config, its own attributes, its generation config and its token embedding."""

from __future__ import annotations

import re
import weakref

import torch

from maskcli.checks.intent import read

SOURCE_PAD = ("src_pad_idx", "src_pad_id", "source_pad_id", "src_pad_token_id", "source_pad_idx")  # each side's pad id
TARGET_PAD = ("trg_pad_idx", "tgt_pad_idx", "trg_pad_id", "tgt_pad_id", "target_pad_id", "target_pad_idx",
              "tgt_pad_token_id", "trg_pad_token_id")


def token_ids(module) -> dict:
    """pad_id and eos_id the program states: its config's pad_token_id / eos_token_id, else the module's own attributes
    of those names, else (pad_id) its token embedding's padding_idx (nn.Embedding(padding_idx=...)) or its one row of
    zeros (TF's zero_pad); a seq2seq model's
    src_pad_id / trg_pad_id from its src_pad_idx / trg_pad_idx and their kin, or each side's embedding's padding_idx; a Flamingo-style model's media_token_id,
    with the only_attend_previous flags its modules hold (by module path)."""
    held = _IDS.get(module)
    if held is not None:
        return held
    found = {}
    config = getattr(module, "config", None)
    if config is None:  # (a wrapper of its own around a model: NV-Embed's embedder, a head over a base model)
        config = _inner_config(module)
    for name, fields in (("pad_id", ("pad_token_id", "pad_id", "pad_idx", "padding_idx")),
                         ("eos_id", ("eos_token_id", "eos_id")), ("media_token_id", ("media_token_id",)),
                         ("src_pad_id", SOURCE_PAD), ("trg_pad_id", TARGET_PAD)):
        for owner in (config, module, read(module, "generation_config")):  # (generate's own pad id: transformers')
            value = next((read(owner, f) for f in fields if isinstance(read(owner, f), int)), None)  # (read: never the program's __getattr__)
            if value is not None and not isinstance(value, bool):
                found[name] = int(value)
                break
    if "src_pad_id" not in found:  # (the source side's embedding, named so, with its padding_idx: Seq2Seq-PyTorch's)
        embedding = next((m for name, m in module.named_modules() if isinstance(m, torch.nn.Embedding)
                          and re.search(r"(?:^|[._])(?:src|source)(?:[._]|$)", name)), None)
        if embedding is not None and embedding.padding_idx is not None:
            found["src_pad_id"] = int(embedding.padding_idx)
    if "trg_pad_id" not in found:  # (the target side's embedding, named so, with its padding_idx: pengshuang/Transformer's)
        embedding = next((m for name, m in module.named_modules() if isinstance(m, torch.nn.Embedding)
                          and re.search(r"(?:^|[._])(?:tgt|trg|target)(?:[._]|$)", name)), None)
        if embedding is not None and embedding.padding_idx is not None:
            found["trg_pad_id"] = int(embedding.padding_idx)
    if "pad_id" not in found:
        embedding = next((m for m in module.modules() if isinstance(m, torch.nn.Embedding)), None)
        if embedding is not None and embedding.padding_idx is not None:
            found["pad_id"] = int(embedding.padding_idx)
        elif embedding is not None:
            zero = _zero_row(embedding.weight)
            if zero is not None:
                found["pad_id"] = zero
    if "media_token_id" in found:  # (what each media cross-attention states of the images it may see: checks/media.py)
        flags = tuple((path, value) for path, m in module.named_modules()
                      if isinstance(value := vars(m).get("only_attend_previous"), bool))
        if flags:
            found["only_attend_previous"] = flags
    try:
        _IDS[module] = found
    except TypeError:
        pass
    return found


def _inner_config(module):
    """The config of the models a module holds, where every one of them states the same pad and eos ids (a wrapper
    speaks for the model it wraps; two models that disagree, a vision tower's and a text model's, say nothing)."""
    configs = {id(c): c for m in module.modules() if m is not module and (c := vars(m).get("config")) is not None}
    stated = {key: (read(c, "pad_token_id"), read(c, "eos_token_id")) for key, c in configs.items()}
    stated = {key: ids for key, ids in stated.items() if any(isinstance(i, int) and not isinstance(i, bool) for i in ids)}
    return configs[next(iter(stated))] if len(set(stated.values())) == 1 else None


def _zero_row(weight) -> int | None:
    """The one row of a token embedding that is exactly zero (TF's `zero_pad=True`, a `padding_idx` set by hand): the
    id the program pads with; None where none or several are, or the table is too large to read once."""
    if not issubclass(type(weight), torch.Tensor) or weight.dim() != 2 or weight.numel() > 1 << 24 or weight.device.type == "meta":
        return None
    with torch.no_grad():
        rows = torch.nonzero((weight == 0).all(dim=1)).flatten()
    return int(rows[0]) if rows.numel() == 1 else None


_IDS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # per module: read once, however many steps call it
