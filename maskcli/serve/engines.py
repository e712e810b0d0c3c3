"""The engine layouts serve reads, each a module with NAME, TITLE, MARKS (names only it uses), READS and load()."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from maskcli.errors import MaskError
from maskcli.serve import choices, flash_attn, flashinfer, sglang, trtllm, vllm
from maskcli.serve.batch import ServeBatch, validate
from maskcli.serve.fields import Fields, as_numbers, numbers

ENGINES = (vllm, sglang, flash_attn, flashinfer, trtllm)
SHARED = ("request_ids",)  # read under every engine's names: which request is which across step files


def by_name(name: str):
    for engine in ENGINES:
        if engine.NAME == name:
            return engine
    raise MaskError(f"unknown engine {name!r}: choose one of {', '.join(e.NAME for e in ENGINES)}")


def detect(keys, source: str):
    """The one engine whose own names the file holds; a file with two engines' names is refused."""
    found = [(engine, [k for k in engine.MARKS if k in keys]) for engine in ENGINES]
    found = [(engine, marks) for engine, marks in found if marks]
    if not found:
        listed = ", ".join(f"{e.NAME}: {', '.join(e.MARKS[:3])}" for e in ENGINES)
        raise MaskError(f"{source!r} holds {', '.join(sorted(keys)[:8]) or 'no tensors'}, none of them an engine's batch "
                        f"metadata names ({listed}, ...)")
    if len(found) > 1:
        said = "; ".join(f"{e.NAME} ({', '.join(marks[:2])})" for e, marks in found)
        raise MaskError(f"{source!r} mixes the names of {len(found)} engines: {said}; save one engine's fields per file")
    return found[0][0]


def read(source: str) -> ServeBatch:
    """The batch in a .pt, .safetensors, .npz or .json file of named tensors, or a FlashInfer API-logging call folder."""
    from maskcli.tensorfile import read_tensors

    from maskcli.files import is_inline
    from maskcli.serve.flashinfer_dump import is_dump, read_dump

    if not is_inline(source) and is_dump(source):
        return _some(from_tensors(read_dump(source), source), source)
    # float64: a JSON float is a whole number or refused (fields.py), and float32 rounds one past 2^24 to another
    tensors = read_tensors(source, "FILE", "float64", numbers=True, lists=choices.NAMES, work=(32, "to read as batch metadata (int64)"))
    source = "inline JSON" if is_inline(source) else source
    if set(tensors) == {""}:
        raise MaskError(f"{source!r} holds one unnamed tensor; save a dict of the engine's named fields (query_start_loc, seq_lens, ...)")
    return _some(from_tensors(tensors, source), source)


def _some(batch: ServeBatch, source: str) -> ServeBatch:
    """A file's batch of at least one request: one of none was "0 requests ... no findings", exit 0 (a traced engine's
    step of none is read as it is)."""
    if batch.requests == 0:
        raise MaskError(f"{source!r}: {batch.name('queries')} holds no request (a batch of 0 requests): give the metadata "
                        "of a step that ran at least one")
    return batch


def from_tensors(tensors: dict, source: str) -> ServeBatch:
    """The batch in named tensors, arrays, lists or numbers (as a file holds them); `source` names it in messages."""
    engine = detect(tensors.keys(), source)
    fields = Fields(numbers(tensors, engine.READS + SHARED, source), source, engine.TITLE)
    batch = engine.load(fields)
    validate(batch, source)
    ids = fields.per_request(fields.vector("request_ids"), batch.requests, "request_ids")
    if ids is not None and np.unique(ids).size != ids.size:
        raise MaskError(f"{source!r}: request_ids {ids[:8].tolist()} name a request twice; give each request its own id")
    batch = batch if ids is None else replace(batch, request_ids=ids)
    return _with_choices(batch, tensors, source)


def _with_choices(batch: ServeBatch, tensors: dict, source: str) -> ServeBatch:
    """The batch with the choice list its file holds, which every draft tree in it must be."""
    names = [name for name in choices.NAMES if name in tensors]
    if not names:
        return batch
    if len(names) > 1:
        raise MaskError(f"{source!r} holds {', '.join(names)}: give one choice list")
    name = names[0]
    if not batch.trees:
        fields = TREE_FIELDS.get(batch.engine)
        how = (f"add the verify step's {' or '.join(fields)}" if fields else
               "serve reads draft trees from FlashInfer's and SGLang's custom_mask and TensorRT-LLM's spec_decoding_packed_mask")
        raise MaskError(f"{source!r} holds {name} but no draft tree's mask to check it against; {how}")
    value = tensors[name]
    value = value.tolist() if hasattr(value, "tolist") else value
    paths = tuple(choices.parse(value, f"{source!r}: {name}"))
    note = f"draft trees checked against {name}: the root and {len(paths)} paths, ordered by depth then path"
    return replace(batch, choices=paths, choices_name=name, notes=batch.notes + (note,))


TREE_FIELDS = {"flashinfer": ("custom_mask",), "sglang": ("custom_mask",), "trtllm": ("spec_decoding_packed_mask",)}
