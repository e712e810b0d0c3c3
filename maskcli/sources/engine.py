"""A mask implied by a serving engine's batch metadata (`maskcli serve FILE`): vLLM's, SGLang's, flash-attn's,
FlashInfer's or TensorRT-LLM's fields, read into one batch by serve/engines.py, and one Mask per request.

Engines keep no mask tensor. A request's queries are its new tokens at positions seq_len - q_len .. seq_len - 1 (the
kernels align the last query with the last key), its keys positions 0 .. seq_len - 1, and its mask the kinds the
metadata states: causal, window(W), local(C), prefix(P) for a cascade's shared prefix, tree(parents) for a draft
tree. Each Mask is made from those kinds at those positions (ServeBatch.mask, mask.from_terms): no expression is
written and parsed back; the request's expression (ServeBatch.expression) is only its name, for the views.
"""

from __future__ import annotations

from maskcli.mask import Mask
from maskcli.serve.batch import ServeBatch
from maskcli.sources.base import Source


def read(spec: str) -> ServeBatch:
    """The batch a metadata FILE holds (a .pt, .safetensors, .npz or .json of one engine's named fields, inline JSON,
    or a FlashInfer API-logging folder): what serve checks beyond the masks (lengths, pages, writes)."""
    from maskcli.serve.engines import read as read_batch

    return read_batch(spec)


def masks(batch: ServeBatch) -> list[Mask | None]:
    """Each request's Mask, in request order; None for a request no frame holds (more queries than keys, or no
    keys: the length rules' findings) or with no queries this step."""
    return [batch.mask(r) for r in range(batch.requests)]


def load(spec: str, options=None) -> list[Mask | None]:
    """Each request's Mask in the batch a metadata FILE holds (`masks`); the mask options do not apply: the metadata
    says every size."""
    return masks(read(spec))


SOURCE = Source("engine", load, read=read)
