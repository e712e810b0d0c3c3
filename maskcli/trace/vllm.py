"""Seeing a running vLLM engine's batches: each metadata builder's build() records the CommonAttentionMetadata it gets.

vLLM keeps no mask tensor (maskcli/serve/vllm.py): a step's mask is what its metadata implies. Every attention
backend's builder is an AttentionMetadataBuilder (vllm/v1/attention/backend.py, class AttentionMetadataBuilder)
whose __init__ stores kv_cache_spec and layer_names, and whose build(common_prefix_len, common_attn_metadata)
the model runner calls once per step and KV-cache group (vllm/v1/worker/utils.py, AttentionGroup.build_metadata).
The base __init__ is wrapped so that each builder's own build() is wrapped on the instance: every backend's
override is seen, with no list of backends. Fields are kept under the names serve's vLLM loader reads, cut to
the batch's real requests and tokens (the tensors are persistent buffers, padded beyond them).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MODULE = "vllm.v1.attention.backend"
PER_REQUEST = ("query_start_loc_cpu", "seq_lens", "block_table_tensor")  # query_start_loc_cpu has one more
PER_TOKEN = ("slot_mapping", "positions")
# the KV-cache specs (vllm/v1/kv_cache_interface.py) whose metadata is a decoder's paged self-attention, as serve
# reads it; Mamba state, cross-attention (encoder lengths), encoder-only and sink or RSWA layers mean something else
READ_SPECS = ("FullAttentionSpec", "SlidingWindowSpec", "ChunkedLocalAttentionSpec", "MLAAttentionSpec")


@dataclass(frozen=True)
class Step:
    """One build() call: the step (counted per builder), the layers it serves, and serve's vLLM fields."""

    step: int
    builder: str
    layers: tuple[str, ...]
    fields: dict
    group: int = 0  # which builder (one per KV-cache group and backend), numbered as first seen


def fields_of(builder, common) -> dict:
    """serve's vLLM field names (maskcli/serve/vllm.py READS) -> numpy arrays or numbers, from one build() call."""
    import torch

    requests, tokens = int(common.num_reqs), int(common.num_actual_tokens)
    out: dict = {}
    for name in PER_REQUEST + PER_TOKEN:
        value = getattr(common, name, None)
        if not isinstance(value, torch.Tensor):
            continue
        keep = requests + 1 if name == "query_start_loc_cpu" else requests if name in PER_REQUEST else tokens
        out[name] = value[:keep].detach().to("cpu").numpy().copy()
    if not isinstance(common.causal, bool):
        raise ValueError("causal is a per-token tensor (a prefix-LM batch), which serve does not read")
    out["causal"] = int(common.causal)
    spec = builder.kv_cache_spec
    out["block_size"] = int(spec.block_size)
    for name in ("sliding_window", "attention_chunk_size"):  # SlidingWindowSpec, ChunkedLocalAttentionSpec
        value = getattr(spec, name, None)
        if value:
            out[name] = int(value)
    return out


class Recorder:
    """Wraps AttentionMetadataBuilder.__init__ while tracing; `steps` holds every build() seen."""

    def __init__(self, active):
        self.active = active  # () -> bool: record now (tracing, and not inside maskcli's own work)
        self.steps: list[Step] = []
        self.failed: list[str] = []  # builds whose fields could not be read, and why
        self.skipped: dict[str, int] = {}  # "builder (spec)" -> builds of layers serve does not read
        self._counts: dict[int, int] = {}
        self._groups: dict[int, int] = {}  # id(builder) -> its group (the builders live as long as the engine)

    def patch(self, module):
        """Wrap module.AttentionMetadataBuilder.__init__; the callable that undoes it."""
        cls = module.AttentionMetadataBuilder
        original = cls.__init__
        recorder = self

        def __init__(self, *args, **kwargs):
            original(self, *args, **kwargs)
            recorder.wrap(self)

        __init__.__wrapped__ = original
        cls.__init__ = __init__
        return lambda: setattr(cls, "__init__", original)

    def wrap(self, builder) -> None:
        build = builder.build
        if getattr(build, "_maskcli_vllm", False):
            return  # (a subclass's __init__ chain reached the base twice)

        def recorded(*args, **kwargs):
            common = kwargs.get("common_attn_metadata", args[1] if len(args) > 1 else None)
            if common is not None and self.active():
                self.record(builder, common)
            return build(*args, **kwargs)

        recorded._maskcli_vllm = True
        builder.build = recorded

    def record(self, builder, common) -> None:
        spec = type(getattr(builder, "kv_cache_spec", None)).__name__
        if spec not in READ_SPECS:
            key = f"{type(builder).__name__} ({spec})"
            self.skipped[key] = self.skipped.get(key, 0) + 1
            return
        try:
            fields = fields_of(builder, common)
        except Exception as error:  # noqa: BLE001 - a vLLM whose metadata differs: said in the report, the run goes on
            self.failed.append(f"{type(builder).__name__}.build: {type(error).__name__}: {error}")
            return
        step = self._counts.get(id(builder), 0)
        self._counts[id(builder)] = step + 1
        group = self._groups.setdefault(id(builder), len(self._groups))
        self.steps.append(Step(step, type(builder).__name__, tuple(getattr(builder, "layer_names", ()) or ()), fields, group))

