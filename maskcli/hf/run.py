"""A tiny model built from its config and run on a padded batch (a prefill, then decode steps), traced with
maskcli's capture: each attention call's mask with its layer, that layer's type and the step.

generate (greedy, every new token fed back) makes the steps as the family's own code makes them: its
cache, its position ids under left padding, its masks. `new_tokens` decode steps are `new_tokens + 1`
generated tokens: the last one is never fed back.
"""

from __future__ import annotations

import contextlib
import re
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from maskcli.errors import MaskError
from maskcli.hf import quiet, reason, require
from maskcli.hf.budget import MOST_ROWS, MOST_TOKENS, Steps
from maskcli.hf.families import MOST_PARAMETERS, layer_types

ATTN = {"sdpa": "sdpa", "eager": "eager", "flex": "flex_attention"}
CACHES = {"dynamic": "dynamic", "static": "static", "sliding": "sliding_window"}
LAYER = re.compile(r"(?:^|\.)(\d+)(?:\.|$)")


@dataclass
class Prompt:
    ids: torch.Tensor  # (B, L) int64
    attention_mask: torch.Tensor  # (B, L) int64, 1 = a real token
    pad_id: int
    side: str


@dataclass
class ModelRun:
    name: str
    config: object
    types: list[str]  # per layer
    prompt: Prompt
    steps: list[str]  # the name of each step: prefill (or its chunks), decode 1, ...
    trace: object  # maskcli.trace.capture.Trace
    calls: list  # the attention calls of the layers, each with .layer, .layer_type, .step_name set in details
    other: list  # calls outside the numbered layers
    timings: dict = field(default_factory=dict)
    generated: list = field(default_factory=list)
    chunk_check: list = field(default_factory=list)  # --prefill-chunk: lines on the chunks against one pass
    chunk_holds: bool = True
    cache_check: list = field(default_factory=list)  # each mask against the keys its cache returned (maskcli.hf.widths)
    cache_holds: bool = True
    cache_first: dict | None = None  # the first cell where a mask and its cache's keys disagree


def prompt(lengths: tuple[int, ...] | None, ids: np.ndarray | None, pad_id: int, side: str, vocab: int) -> Prompt:
    """The batch: --lengths made into ids (distinct tokens, none the pad id) padded on `side`, or --ids as given."""
    if not 0 <= pad_id < vocab:
        raise MaskError(f"--pad-id {pad_id}: the tiny model's vocabulary is 0..{vocab - 1}: give a pad id in it")
    given = ids is not None
    if ids is None:
        lengths = lengths or (5, 3)
        if min(lengths) < 1 or max(lengths) > MOST_TOKENS or len(lengths) > MOST_ROWS:
            raise MaskError(f"--lengths {','.join(map(str, lengths))[:60]}: give 1 to {MOST_ROWS} batch rows of 1 to "
                            f"{MOST_TOKENS} tokens each")
        width = max(lengths)
        rows = []
        for b, length in enumerate(lengths):
            tokens = [t for t in range(1 + 7 * b, 10_000) if t % vocab != pad_id][:length]
            real = [t % vocab for t in tokens]
            pads = [pad_id] * (width - length)
            rows.append(pads + real if side == "left" else real + pads)
        ids = np.asarray(rows, dtype=np.int64)
    ids = np.asarray(ids, dtype=np.int64)
    if ids.ndim != 2 or ids.shape[1] == 0:
        raise MaskError("--ids: give one row of token ids per batch row, like 5,6,7;0,8,9")
    if ids.shape[0] > MOST_ROWS or ids.shape[1] > MOST_TOKENS:
        raise MaskError(f"--ids: give 1 to {MOST_ROWS} batch rows of 1 to {MOST_TOKENS} tokens each")
    if ids.min() < 0 or ids.max() >= vocab:
        raise MaskError(f"--ids: the tiny model's vocabulary is 0..{vocab - 1}: give ids in it (the pad id is {pad_id})")
    real = ids != pad_id
    if not real.any(axis=1).all():
        raise MaskError(f"--ids: a batch row is all padding (pad id {pad_id}): give it a token")
    if given:  # the padding is where the pad ids are: say which side that is
        before = [(~row[: int(np.argmax(row))]).any() for row in real]
        after = [(~row[int(np.argmax(row)):]).any() for row in real]
        side = "no" if not any(before) and not any(after) else "left" if not any(after) else "right" if not any(before) else "mixed"
    return Prompt(torch.from_numpy(ids), torch.from_numpy(real.astype(np.int64)), pad_id, side)


SUPPORTS = {"sdpa": "_supports_sdpa", "flex": "_supports_flex_attn"}  # eager: every family has it


def check_attn(config, attn: str, name: str) -> None:
    """Refuse an attention implementation the family's model class does not support, before anything is built:
    the class flags transformers itself checks (modeling_utils.py, PreTrainedModel._sdpa_can_dispatch and
    _flex_attn_can_dispatch raise ValueError where _supports_sdpa / _supports_flex_attn is False)."""
    flag = SUPPORTS.get(attn)
    if flag is None:
        return
    mapping = require().AutoModelForCausalLM._model_mapping
    try:
        cls = mapping[type(config)]
    except (KeyError, ValueError):
        return  # (not a causal LM: build says so, with transformers' own words)
    if not getattr(cls, flag, True):
        others = [other for other, other_flag in SUPPORTS.items() if getattr(cls, other_flag, False)]
        choices = " or ".join(["eager", *others])
        raise MaskError(f"{name} has no --attn {attn} in transformers {require().__version__} ({cls.__name__}.{flag} is "
                        f"False): try --attn {choices}")


def build(config, attn: str, name: str):
    """The model, random weights, eval mode; refused when it does not shrink (counted on the meta device first)."""
    transformers = require()
    with quiet():
        try:
            with torch.device("meta"):
                shell = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=ATTN[attn])
            count = sum(p.numel() for p in shell.parameters())
            if count > MOST_PARAMETERS:
                raise MaskError(f"{name} does not shrink to a tiny model: {count:,} parameters after setting the sizes maskcli "
                                "knows (its config names other sizes); try a config.json with small sizes")
            torch.manual_seed(0)
            return transformers.AutoModelForCausalLM.from_config(config, attn_implementation=ATTN[attn]).eval()
        except MaskError:
            raise
        except Exception as error:  # noqa: BLE001 - the family's own code refused this config: one line saying why
            hint = "; try --attn eager" if attn != "eager" and _builds(transformers, config, "eager") else ""
            raise MaskError(f"{name} cannot be built tiny with --attn {attn}: {reason(error)}{hint}") from None


def _builds(transformers, config, attn: str) -> bool:
    """The family's model builds with `attn` (on the meta device: no memory, no weights), so that the hint is true."""
    try:
        with torch.device("meta"):
            transformers.AutoModelForCausalLM.from_config(config, attn_implementation=ATTN[attn])
    except Exception:  # noqa: BLE001 - it fails the same way: no other --attn to suggest
        return False
    return True


def run(name: str, config, the_prompt: Prompt, new_tokens: int = 2, attn: str = "sdpa", cache: str = "dynamic",
        prefill_chunk: int | None = None, progress=None) -> ModelRun:
    """Build, then generate under maskcli's trace; the calls sorted into layers, layer types and steps. With
    `prefill_chunk`, the prompt is prefilled once more in one pass and each layer's chunks checked against it.
    `progress(done, total)` hears of each generated token."""
    if not 0 <= new_tokens <= MOST_TOKENS:
        raise MaskError(f"--new-tokens {new_tokens}: give 0 to {MOST_TOKENS} decode steps")
    if prefill_chunk is not None and prefill_chunk < 1:
        raise MaskError(f"--prefill-chunk {prefill_chunk}: give 1 or more tokens")
    check_attn(config, attn, name)
    config.pad_token_id = the_prompt.pad_id
    started = time.perf_counter()
    model = build(config, attn, name)
    built = time.perf_counter()
    options = dict(max_new_tokens=new_tokens + 1, min_new_tokens=new_tokens + 1, do_sample=False,
                   pad_token_id=the_prompt.pad_id, cache_implementation=CACHES[cache])
    if prefill_chunk is not None:
        options["prefill_chunk_size"] = prefill_chunk
    streamer = None if progress is None else {"streamer": Steps(progress, new_tokens + 1)}
    tracer = _generate(model, the_prompt, options | (streamer or {}), attn, cache, name, prefill_chunk)
    ran = time.perf_counter()
    groups = {path: module.num_key_value_groups for path, module in model.named_modules()
              if isinstance(getattr(module, "num_key_value_groups", None), int) and module.num_key_value_groups > 1}
    calls, other = _placed(tracer, config, the_prompt.ids.shape[1], prefill_chunk, groups)
    if not calls:
        raise MaskError(f"{name} --attn {attn}: no attention call of its layers was captured "
                        f"({len(tracer.calls)} calls elsewhere): maskcli cannot see this family's attention")
    steps = step_names(max((call.step for call in calls), default=-1) + 1, the_prompt.ids.shape[1], prefill_chunk)
    for call in calls:
        call.details["step_name"] = steps[call.step] if call.step < len(steps) else f"step {call.step}"
    generated = tracer.out[:, the_prompt.ids.shape[1]:].tolist()
    result = ModelRun(name, config, layer_types(config), the_prompt, steps, tracer, calls, other,
                      {"build_s": built - started, "run_s": ran - built}, generated)
    from maskcli.hf import widths

    shared = getattr(config, "num_kv_shared_layers", 0)
    result.cache_check, result.cache_holds, result.cache_first = widths.check(
        calls, tracer.updates, steps, shared if isinstance(shared, int) and not isinstance(shared, bool) else 0)
    result.cache_check += widths.order_notes(calls, tracer.updates, steps)
    if prefill_chunk is not None:
        from maskcli.hf.chunks import check

        single = {key: value for key, value in options.items() if key != "prefill_chunk_size"}
        single.update(max_new_tokens=1, min_new_tokens=1)
        one_pass, _ = _placed(_generate(model, the_prompt, single, attn, cache, name, None), config, the_prompt.ids.shape[1],
                              None, groups)
        chunks = -(-the_prompt.ids.shape[1] // prefill_chunk)
        result.chunk_check, result.chunk_holds = check(calls, one_pass, result.types, the_prompt.ids.shape[1], chunks, prefill_chunk)
    return result


def _placed(tracer, config, prompt_len: int, prefill_chunk: int | None, groups: dict | None = None) -> tuple[list, list]:
    """The layers' calls (as _sorted gives them), each with its query positions and its keys' from its cache.
    `groups`: query heads per key head of each attention module (its num_key_value_groups) where more than one: a
    one-query SDPA call of such a module has its heads packed into the query axis (_unpack_heads)."""
    _forward_steps(tracer)
    calls, other = _sorted(tracer, config)
    by_call = {(u.layer, u.step): u for u in tracer.updates}
    for call in calls:
        packed = (groups or {}).get(call.where, 1)
        if packed > 1 and call.api == "sdpa" and call.shape[2] == packed and call.q[1] == call.k[1] \
                and _queries(call.step, prompt_len, prefill_chunk)[1] == 1:
            _unpack_heads(call, packed)
        call.details.update(positions(call, prompt_len, prefill_chunk, by_call.get((call.details["layer"], call.step))))
    return calls, other


def _unpack_heads(call, packed: int) -> None:
    """The call as the model meant it: (B, H, 1, Lk) for one query, where transformers' SDPA path packed a GQA layer's
    query heads into the query axis (integrations/sdpa_attention.py, pack_gqa: (B, H, 1, D) -> (B, H / g, g, D), its
    mask (B, 1, 1, Lk) broadcast, or (B, H, 1, Lk) reshaped the same way); the reshape undone, stored again."""
    from maskcli import tracefile
    from maskcli.trace.interface import unpacked_heads
    from maskcli.trace.store import collapse, keep_stored, stored_form

    stored, trace = call.stored, call.trace
    b, h, q_len, k_len = packed_shape = call.shape
    shape = (b, h * q_len, 1, k_len)
    call.details["packed_heads"] = packed
    call.q = [call.q[0], h * q_len, 1, *call.q[3:]]
    call.shape = shape
    if stored is None or stored["form"] == "stats":
        return
    keep = collapse(unpacked_heads(torch.from_numpy(np.array(tracefile.dense(stored))), packed_shape))  # (a copy: writable)
    call.mask = keep_stored(trace, stored_form(keep.contiguous(), shape, trace.max_bytes - trace.bytes, trace.max_bytes), shape)


def _queries(step: int, prompt_len: int, prefill_chunk: int | None) -> tuple[int, int]:
    """(first position, count) of the queries generate feeds at `step`: the prompt (or its chunk), then one a step."""
    chunks = 1 if not prefill_chunk else -(-prompt_len // prefill_chunk)
    if step >= chunks:
        return prompt_len + step - chunks, 1
    if not prefill_chunk:
        return 0, prompt_len
    start = step * prefill_chunk
    return start, min(prefill_chunk, prompt_len - start)


def _forward_steps(tracer) -> None:
    """Each call's step made the how-manieth forward of the model at its call site: a layer that calls its kernel twice
    in one forward (DiffLlama's two halves of the values) is one step, not two (the trace counts calls per site)."""
    import bisect

    tops = sorted((top.first, top.end) for top in tracer.tops)
    firsts = [first for first, _ in tops]
    seen: dict = {}
    for call in tracer.calls:
        at = bisect.bisect_right(firsts, call.index) - 1
        if at < 0 or call.index >= tops[at][1]:
            continue  # (made outside any forward: its own count stays)
        steps = seen.setdefault(call.where, [])
        if not steps or steps[-1] != at:
            steps.append(at)
        call.step = len(steps) - 1


def _generate(model, the_prompt: Prompt, options: dict, attn: str, cache: str, name: str, prefill_chunk: int | None):
    """generate under a Trace; the Trace, with the generated ids as .out."""
    from maskcli.trace.capture import Trace

    from maskcli.hf.cache import Watch
    from maskcli.trace.modules import paused

    tracer = Trace(("sdpa", "flex", "softmax"))
    watch = Watch(lambda: paused(tracer.mode))
    if any(isinstance(getattr(module, "sinks", None), torch.nn.Parameter) for module in model.modules()):
        # GPT-OSS's learned sinks: a softmax one column wider than the keys its layer's cache update (made just before
        # it) returned has the sink as its last column, which the trace cuts as it records the call (no interface
        # frame counts the keys here: `model` traces no AttentionInterface)
        tracer.sink_keys = lambda: len(watch.updates[-1].slots) if watch.updates else None
    with quiet():
        try:
            with tracer, watch, torch.no_grad(), _flex_uncompiled(attn == "flex"):
                out = model.generate(the_prompt.ids, attention_mask=the_prompt.attention_mask, **options)
        except Exception as error:  # noqa: BLE001 - the family's code refused this run: one line saying why
            raise MaskError(f"{name} cannot run --attn {attn} --cache {cache}"
                            f"{f' --prefill-chunk {prefill_chunk}' if prefill_chunk else ''}: {reason(error)}") from None
    tracer.out, tracer.updates = out, watch.updates
    return tracer


def _sorted(tracer, config) -> tuple[list, list]:
    """The calls of the numbered layers (each given its layer and layer type), and the others."""
    types = layer_types(config)
    calls, other = [], []
    for call in tracer.calls:
        found = LAYER.findall(call.where)
        layer = int(found[-1]) if found else None
        if layer is None or layer >= len(types):
            other.append(call)
            continue
        call.details["layer"], call.details["layer_type"] = layer, types[layer]
        calls.append(call)
    return calls, other


@contextlib.contextmanager
def _flex_uncompiled(active: bool):
    """transformers runs flex_attention under torch.compile, where no capture can see it: while traced, its
    flex path calls flex_attention itself (the same mask, the block mask it built, run eagerly)."""
    if not active:
        yield
        return
    import transformers.integrations.flex_attention as hf_flex
    from torch.nn.attention import flex_attention as torch_flex

    def uncompiled(query, key, value, training=False, **kwargs):
        return torch_flex.flex_attention(query, key, value, **kwargs)

    original = hf_flex.compile_friendly_flex_attention
    hf_flex.compile_friendly_flex_attention = uncompiled
    try:
        yield
    finally:
        hf_flex.compile_friendly_flex_attention = original


def positions(call, prompt_len: int, prefill_chunk: int | None, update) -> dict:
    """The call's query positions [start, end), and its keys' as its cache's slots hold them (maskcli.hf.cache): [k0, k1)
    where the slots are in order (a static cache's slots not yet written count on after the last one), else the
    position of each slot ("slots", -1 for none), the slots being a ring."""
    q_len, k_len = call.shape[2:]
    start, count = _queries(call.step, prompt_len, prefill_chunk)
    start += max(count - q_len, 0)  # fewer queries than the step feeds are its last ones (Gemma 4's KV-shared layers
    # slice the prefill to generate's logits_to_keep before they attend)
    found = {"queries": [start, start + q_len]}
    if update is None:  # no cache seen: the keys are the last Lk positions, as a cache that keeps them all returns
        found["keys"] = [start + q_len - k_len, start + q_len]
    elif update.in_order():
        first = update.first()
        found["keys"] = [first, first + k_len]
        if start - first != k_len - q_len:  # a static cache's empty slots after the queries: say where they sit
            found["q_start"] = start - first
    else:
        found["slots"] = update.slots[:k_len].tolist()
    return found


def tryout(name: str) -> str:
    """'runs' where the family builds tiny and runs a padded prefill and a decode step (eager, which every family
    has; sdpa too where it runs), else why not, in one clause."""
    from maskcli.hf.families import default_config, tiny

    try:
        config = tiny(default_config(name), name=name)
        batch = prompt((3, 2), None, config.pad_token_id, "left", 128)
        run(name, config, batch, new_tokens=1, attn="eager")
    except MaskError as error:
        return str(error).removeprefix(name).lstrip(": ")
    try:
        run(name, config, batch, new_tokens=1, attn="sdpa")
    except MaskError:
        return "runs (eager only)"
    return "runs"


def step_names(count: int, prompt_len: int, prefill_chunk: int | None) -> list[str]:
    chunks = 1 if not prefill_chunk else -(-prompt_len // prefill_chunk)
    names = ["prefill"] if chunks == 1 else [f"prefill {i + 1}/{chunks}" for i in range(chunks)]
    return (names + [f"decode {i + 1}" for i in range(max(0, count - chunks))])[:max(count, 0)]
