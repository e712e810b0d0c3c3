"""Families from their config classes: which build a causal LM, what in their config shapes masks, and the
config shrunk to a tiny width that keeps it (sliding window, layer types and their pattern, chunk size, pad id).

Sizes are set by the names transformers' configs use for them; a family whose sizes go by other names stays
large, and is refused (by its parameter count on the meta device) rather than built.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass

from maskcli.checks.configread import read
from maskcli.errors import MaskError
from maskcli.hf import quiet, reason, require

# attribute -> tiny value, set where the config has the attribute (None included: head_dim None is hidden / heads)
SIZES = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 16,
         "vocab_size": 128, "vocab_size_per_layer_input": 128, "hidden_size_per_layer_input": 8,  # (Gemma 3n's and Gemma
         "lru_width": 32}  # 4's per-layer embeddings; RecurrentGemma's recurrent width)
# an encoder's and a decoder's own sizes (BART's, Whisper's: num_hidden_layers and num_attention_heads name the
# encoder's), as SIZES' attribute says them; the layer counts as num_hidden_layers
ENCODER_DECODER_SIZES = {"encoder_attention_heads": "num_attention_heads", "decoder_attention_heads": "num_attention_heads",
                         "encoder_ffn_dim": "intermediate_size", "decoder_ffn_dim": "intermediate_size",
                         "encoder_layers": "num_hidden_layers", "decoder_layers": "num_hidden_layers"}
# set only where not None (q_lora_rank None: no LoRA on the queries): multi-head latent attention's widths (DeepSeek's
# head_dim is its rotary part, qk_rope_head_dim, so both are SIZES' head_dim) and a partial rotary width (GPT-J's)
LATENT = {"qk_rope_head_dim": 16, "qk_nope_head_dim": 16, "qk_head_dim": 32, "v_head_dim": 16, "kv_lora_rank": 16,
          "q_lora_rank": 16, "rotary_dim": 8}
# set only where not None: None says the family has no experts
EXPERTS = {"moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "num_experts": 4, "num_local_experts": 4,
           "n_routed_experts": 4, "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1}  # (the last two: a router's
# groups of experts, DeepSeek-V3's: 8 groups of 4 experts were 0 experts a group)
# query and key heads equal, in every layer (a family's per-layer counts too): with fewer key heads, transformers'
# SDPA decode packs the query heads into the query axis (maskcli.hf.run unpacks it, where key heads go by other names)
MOST_PARAMETERS = 3_000_000
# a tiny layer is about 10,000 parameters, so MOST_PARAMETERS holds some 300: a config whose last new layer type comes
# later is refused before a layer is built (100,000 layers took minutes to build, then were refused by their count)
MOST_LAYERS = 256
MOST_READ_LAYERS = 2**20  # layers a config.json may say: each is read by rule (layer_types), some seconds for this many
MOST_WINDOW = 2**40  # a sliding window, chunk size or prefill chunk past it: transformers overflows int64 arithmetic
LONGEST_PATTERN = 48  # items (runs, or repeated groups of runs) written out; past it, a count per type
LONGEST_GROUP = 16  # runs in a repeated group: looking for longer ones made 100,000 layers in no pattern take hours
SHAPERS = ("sliding_window", "use_sliding_window", "attention_chunk_size", "cache_implementation")


@dataclass
class Family:
    name: str  # the model_type: llama, gemma3_text, ...
    config_class: str
    shapes: str  # what shapes its masks, in words: "sliding_window 4096; layer_types sliding_attention x5, full_attention"


def names() -> list[str]:
    """The model types this transformers maps to a causal-LM class, decoder-only ones (no encoder-decoder)."""
    require()
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(name for name in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES if name in CONFIG_MAPPING_NAMES)


def default_config(name: str):
    """The family's config with its class defaults (its text config where it has one)."""
    transformers = require()
    if name not in names():
        from difflib import get_close_matches

        near = get_close_matches(name, names(), n=3)
        hint = f" (did you mean {', '.join(near)}?)" if near else ""
        raise MaskError(f"unknown model family {name!r}{hint}: maskcli model --list lists the families transformers "
                        f"{transformers.__version__} builds as a causal LM, or give a local config.json")
    try:
        with quiet():
            config = transformers.AutoConfig.for_model(name)
    except Exception as error:  # noqa: BLE001 - the family's own config class refuses its defaults: one line saying why
        raise MaskError(f"{name}: its config class fails with its own defaults: {reason(error)}") from None
    return text_config(config, name)


def text_config(config, name: str):
    try:
        return config.get_text_config() if hasattr(config, "get_text_config") else config
    except ValueError as error:
        raise MaskError(f"{name}: no one text config to build ({reason(error)})") from None


def _read_json(path: str):
    """The file's JSON value; a file that is not JSON is a MaskError that quotes it."""
    try:
        with open(path, encoding="utf-8") as handle:
            return json.load(handle)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise MaskError(f"cannot read {path!r} as a config.json: {error}") from None


def file_config(path: str):
    """A local config.json (never a download): its model_type's config class with the file's values."""
    transformers = require()
    values = _read_json(path)
    if not isinstance(values, dict) or not isinstance(values.get("model_type"), str):
        raise MaskError(f"{path!r} has no \"model_type\": give a model's config.json (its model_type names the family)")
    kind = values.pop("model_type")
    for name in ("sliding_window", "attention_chunk_size"):  # a negative size was read as no window at all, silently;
        size = values.get(name)  # 0 ended in "cannot run ...: RuntimeError: ZeroDivisionError" or a tensor size mismatch
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
            raise MaskError(f"{path!r}: {name} {json.dumps(size)[:40]} is no size in tokens: give a whole number of 1 or more, or null for none")
        if isinstance(size, int) and size > MOST_WINDOW:  # 2^63 ended in "cannot run ...: Overflow when unpacking long long"
            raise MaskError(f"{path!r}: {name} {size} is past the {MOST_WINDOW:,} tokens maskcli runs: give a smaller one")
    count = values.get("num_hidden_layers")  # -4 read as a model of no layers; 10^11 was read layer by layer, for ever
    if count is not None and (isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= MOST_READ_LAYERS):
        raise MaskError(f"{path!r}: num_hidden_layers {json.dumps(count)[:40]} is not a number of layers: give a whole "
                        f"number from 1 to {MOST_READ_LAYERS:,} (models have a few hundred at most)")
    for name in ("num_attention_heads", "num_key_value_heads"):  # 0 ended in "ZeroDivisionError: integer division or modulo by zero"
        heads = values.get(name)
        if heads is not None and (isinstance(heads, bool) or not isinstance(heads, int) or heads < 1):
            raise MaskError(f"{path!r}: {name} {json.dumps(heads)[:40]} is not a number of heads: give a whole number of 1 or more")
    try:
        with quiet():
            config = transformers.AutoConfig.for_model(kind, **values)
    except Exception as error:  # noqa: BLE001 - the config class refused the file's values: one line saying why
        raise MaskError(f"{path!r}: model_type {kind!r}: {reason(error)}") from None
    return text_config(config, kind)


def load(source: str):
    """A family name or a local .json file, as the config it names (class defaults, or the file's values)."""
    if source.lower().endswith(".json") or os.sep in source:
        if not os.path.isfile(source):
            what = ("is a directory" if os.path.isdir(source) else "is not a regular file") if os.path.exists(source) else ""
            raise MaskError(f"{source!r} {what}: give a local config.json, or a family name (maskcli model --list)" if what
                            else f"no such config file {source!r}: give a local config.json, or a family name (maskcli model --list)")
        return file_config(source)
    return default_config(source)


def use_cache_of(source: str) -> tuple[bool, str]:
    """use_cache as a model of this config runs with (the forward's default, merge_with_config_defaults), and where
    it was read: a config.json's own value (no transformers needed), else the config class's default."""
    if source.lower().endswith(".json") and os.path.isfile(source):
        values = _read_json(source)
        if isinstance(values, dict) and isinstance(values.get("use_cache"), bool):
            return values["use_cache"], f"{source} sets it"
    config = load(source)
    # no use_cache at all: the forward's use_cache stays None, so no cache is made
    value = bool(getattr(config, "use_cache", None))
    return value, f"{type(config).__name__}'s default" + (f"; {source} does not set it" if source.lower().endswith(".json") else "")


def layer_types(config) -> list[str]:
    """Each layer's attention kind: the config's layer_types, else each layer's kind as trace's rules read it
    (maskcli.checks.config.layer_kind: a sliding window pattern, sliding_window_layers, max_window_layers, Llama 4's
    no_rope_layers), so that `model`, serve and shard --model and the rules read a config one way; where that leaves a
    layer unknown (a per-layer field it does not read, GPT-Neo's attention_layers), what its sliding window or chunk
    size makes every layer."""
    from maskcli.checks.config import layer_kinds

    found = getattr(config, "layer_types", None)
    count = getattr(config, "num_hidden_layers", None) or 0
    if found:
        return list(found)
    kinds = layer_kinds(config, range(count))
    if all(kinds):
        return [kind[0] for kind in kinds]
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True) is not False:
        kind = "sliding_attention"
    elif getattr(config, "attention_chunk_size", None):
        kind = "chunked_attention"
    else:
        kind = "full_attention"
    return [kind] * count


def pattern(types: list[str]) -> str:
    """'(sliding_attention x5, full_attention) x4, sliding_attention x2 (26 layers)': the layer types as runs, a
    repeated group of runs written once (and the layers counted, where a group makes that a sum to work out)."""
    if not types:
        return ""
    runs: list[list] = []
    for kind in types:
        if runs and runs[-1][0] == kind:
            runs[-1][1] += 1
        else:
            runs.append([kind, 1])
    if len(runs) == 1:
        return f"{types[0]} (every layer)"
    groups = _grouped([kind + (f" x{count}" if count > 1 else "") for kind, count in runs])
    if len(groups) > LONGEST_PATTERN:  # written out, 100,000 layers in no pattern would be 800,000 characters
        counts = {kind: types.count(kind) for kind in dict.fromkeys(types)}
        return ", ".join(f"{kind} x{count:,}" for kind, count in counts.items()) + f" ({len(types):,} layers in {len(runs):,} runs)"
    return ", ".join(groups) + (f" ({len(types)} layers)" if any(g.startswith("(") for g in groups) else "")  # runs count them


def _grouped(items: list[str]) -> list[str]:
    """Runs of a repeated group as one: a, b, a, b, a, b, c -> (a, b) x3, c (so that --list keeps a row a line)."""
    out, at = [], 0
    while at < len(items):
        best = (1, 1)  # (group size, repeats): the group that covers most, the shortest of those
        for size in range(1, min(LONGEST_GROUP, (len(items) - at) // 2) + 1):
            group, repeats = items[at:at + size], 1
            while items[at + repeats * size:at + (repeats + 1) * size] == group:
                repeats += 1
            if repeats > 1 and size * repeats > best[0] * best[1]:
                best = (size, repeats)
        size, repeats = best
        if repeats == 1:
            out.append(items[at])
        else:
            group = ", ".join(items[at:at + size])
            out.append(f"({group}) x{repeats}" if size > 1 else f"{group} x{repeats}")
        at += size * repeats
    return out


def shapes(config) -> str:
    """What in the config shapes its masks, in words."""
    parts = []
    for name in SHAPERS:
        value = getattr(config, name, None)
        if value is not None and not (name == "use_sliding_window" and getattr(config, "sliding_window", None) is None):
            parts.append(f"{name} {value}")
    types = layer_types(config)
    if len(set(types)) > 1 or (types and types[0] != "full_attention"):
        parts.append(f"layer_types {pattern(types)}")
    decoder = getattr(config, "is_decoder", None)  # (every config keeps the field; BERT's family reads it)
    if decoder is False and not getattr(config, "is_encoder_decoder", False) and _reads_is_decoder(config.model_type):
        return "; ".join(parts) or "both ways: is_decoder False (the model attends as an encoder, no causal mask)"
    return "; ".join(parts) or "causal (no window, chunks or layer types)"


@functools.lru_cache(maxsize=None)
def _reads_is_decoder(model_type: str) -> bool:
    """Whether the family's modeling code reads is_decoder, and its causal LM does not set it True itself: BERT's
    attends both ways unless told; GPT-NeoX's names it only in an example, TrOCR's causal LM sets it (BART's is the
    decoder of an encoder-decoder: is_encoder_decoder). Read from the module's source, not imported."""
    import importlib.util
    import re

    from transformers.models.auto.configuration_auto import model_type_to_module_name

    module = model_type_to_module_name(model_type)
    try:
        spec = importlib.util.find_spec(f"transformers.models.{module}.modeling_{module}")
        with open(spec.origin, encoding="utf-8") as file:
            code = [line for line in file if "is_decoder" in line and ">>>" not in line]
    except (ImportError, AttributeError, TypeError, OSError, ValueError):
        return True  # (no source to read: as the config says)
    forced = any(re.match(r"\s*(self\.)?config\.is_decoder\s*=\s*True", line) for line in code)
    return bool(code) and not forced


def listing() -> list[Family]:
    """Every family that builds a causal LM, with what shapes its masks (read from its config class's defaults)."""
    found = []
    for name in names():
        try:
            config = default_config(name)
        except Exception as error:  # noqa: BLE001 - a family whose config cannot even be made says why, and the list goes on
            found.append(Family(name, "?", f"its config class fails: {reason(error)}"))
            continue
        found.append(Family(name, type(config).__name__, shapes(config)))
    return found


def tiny(config, window: int | None = None, chunk_size: int | None = None, name: str = "the model"):
    """The config shrunk to a tiny width, keeping what shapes masks: the first layers up to one of each layer type,
    the sliding window and chunk size (or --window, --chunk-size), and a pad id inside the tiny vocabulary."""
    try:
        return _tiny(config, window, chunk_size, name)
    except MaskError:
        raise
    except Exception as error:  # noqa: BLE001 - a config whose sizes are per layer (or otherwise its own): say so
        raise MaskError(f"{name} cannot be made tiny: {reason(error)}") from None


def _tiny(config, window: int | None, chunk_size: int | None, name: str):
    count = getattr(config, "num_hidden_layers", None)
    if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count < 1):
        raise MaskError(f"{name}: num_hidden_layers {count!r}: a model has a whole number of layers, 1 or more")
    types = layer_types(config)
    compressed = sorted({kind for kind in types if "compressed" in kind})
    if compressed:  # (DeepSeek-V4's: its softmax's last columns are blocks of tokens, not positions)
        raise MaskError(f"{name}: its {' and '.join(compressed)} layers attend to compressed keys, one per block of "
                        "tokens, beside the tokens' own: maskcli reads each key column as one position, and cannot place them")
    firsts = [types.index(kind) for kind in dict.fromkeys(types)]
    layers = max(2, max(firsts, default=0) + 1)
    if layers > MOST_LAYERS:
        last = types[max(firsts)]
        raise MaskError(f"{name}: its first {last} layer is layer {layers - 1:,}, so a tiny model with one layer of each type "
                        f"would have {layers:,} layers, past the {MOST_LAYERS} maskcli builds (about {MOST_PARAMETERS:,} "
                        f"parameters): give a config.json whose layer_types has each type within its first {MOST_LAYERS} "
                        f"layers (num_hidden_layers to match)")
    overrides = _per_layer(config)  # (Gemma 4's full layers' head_dim: read where each layer keeps it)
    changes = {key: value for key, value in SIZES.items() if _has(config, key)}
    changes |= {key: value for key, value in (EXPERTS | LATENT).items() if read(config, key) is not None}
    if any(read(config, key) for key in ("num_experts", "num_local_experts", "n_routed_experts")) \
            and _has(config, "num_experts_per_tok"):  # experts, and a router whose top-k the defaults leave None
        changes["num_experts_per_tok"] = EXPERTS["num_experts_per_tok"]  # (DeepSeek-V2's: its own default cannot run)
    shared = read(config, "num_kv_shared_layers")  # the last layers reuse earlier layers' keys (Gemma 3n's): as many
    if isinstance(shared, int) and not isinstance(shared, bool) and shared > 0:  # layers again, each type among both
        layers = layers * 2 if len(types) >= layers * 2 else layers
        changes["num_kv_shared_layers"] = layers // 2 if layers % 2 == 0 and layers // 2 <= shared else 0
    changes["num_hidden_layers"] = layers
    for key, value in vars(config).items():  # head counts kept per layer (Laguna's num_attention_heads_per_layer)
        size = SIZES.get(key.removesuffix("_per_layer")) if key.endswith("_per_layer") else None
        if size is not None and isinstance(value, (list, tuple)):
            changes[key] = [size] * layers
        elif isinstance(value, int) and not isinstance(value, bool) and key in ENCODER_DECODER_SIZES:
            changes[key] = layers if key.endswith("_layers") else SIZES[ENCODER_DECODER_SIZES[key]]
    if getattr(config, "layer_types", None):
        changes["layer_types"] = list(config.layer_types[:layers])
    for flag, attribute, value in (("--window", "sliding_window", window), ("--chunk-size", "attention_chunk_size", chunk_size)):
        if value is None:
            continue
        if not 1 <= value <= MOST_WINDOW:  # (2^63 ended in "cannot run ...: Overflow when unpacking long long")
            raise MaskError(f"{flag} {value}: give 1 to {MOST_WINDOW:,} tokens")
        if not hasattr(config, attribute):
            raise MaskError(f"{flag} {value}: {name} has no {attribute} in its config, so {flag} would change nothing")
        changes[attribute] = value
    for key in SIZES.keys() & changes.keys():  # a size kept per layer (Gemma 3n's intermediate_size): one per tiny layer
        if isinstance(read(config, key), (list, tuple)):
            changes[key] = [changes[key]] * layers
    pad = getattr(config, "pad_token_id", None)
    changes["pad_token_id"] = pad if isinstance(pad, int) and 0 <= pad < SIZES["vocab_size"] else 0
    for key, value in changes.items():
        declared = getattr(type(config), getattr(type(config), "attribute_map", {}).get(key, key), None)  # (Bamba's
        # layer_types is its layers_block_type, worked out from attn_layer_indices)
        if isinstance(declared, property) and declared.fset is None:
            continue  # worked out from the others (Falcon's head_dim: hidden_size / num_attention_heads)
        try:
            with quiet():
                setattr(config, key, value)
        except Exception as error:  # noqa: BLE001 - a config that refuses a size: one line saying which
            raise MaskError(f"{name} cannot be made tiny: setting {key} fails ({reason(error)})") from None
    if overrides is not None:  # each tiny layer's own values: the sizes tiny as the whole model's, the rest as they were
        kept = {index: {key: changes.get(key, value) for key, value in values.items()}
                for index, values in overrides.items() if index < layers}
        with quiet():
            config.per_layer_config = kept or None
    return config


def _per_layer(config) -> dict | None:
    """{layer: {attribute: value}} a heterogeneous config (transformers' per_layer_config) overrides, taken off the
    config so its global values can be read and set; None for a config with none."""
    spec = getattr(config, "__dict__", {}).get("_heterogeneity_spec")
    if spec is None:
        return None
    overrides = {int(index): dict(values) for index, values in spec.per_layer_overrides.items()}
    config.per_layer_config = None
    return overrides


def _has(config, key: str) -> bool:
    try:
        return hasattr(config, key)
    except Exception:  # noqa: BLE001 - a config's own __getattribute__ that refuses a name (a per-layer one) has it
        return True


