"""The program's stated intent: the attention fields its configs state, wherever it keeps them, each with its source.

A config is any object or dict that carries one of FIELDS: a transformers config, a dataclass, a SimpleNamespace, an
argparse Namespace, a plain dict or an object of a class named like one (ModelArgs, GPTConfig, HParams). Trace finds
them once per outermost module (trace/stated.py): those its modules hold as attributes (`self.config`, `self.cfg`,
`self.args`, `self.hparams`, ...), each speaking for the calls at or under that module; else the one config the
program's own variables hold where the model is called (`hf_config = {...}` at the top of the main module, a `cfg` in
main() handed to a builder), speaking for every call. Only the fields are kept (read once, not the object).

Where configs that speak for one call state a field differently (two configs that disagree), the field is left out:
nothing is expected of it. A layer's kind comes from the most explicit field (layer_types, then a pattern, then Qwen2's
max_window_layers, then sliding_window / attention_chunk_size alone); `implicit` says it came from sliding_window alone
in a config that is not transformers' (a hand-written Gemma may alternate with nothing that says so: config.py then
speaks only where no layer has the window).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from maskcli.checks.configread import LIBRARIES, MISSING, StaticView, class_fields, dynamic, read  # noqa: F401 - (read from here too)
from maskcli.checks.configread import added as _added, same as _same
from maskcli.checks.fieldnames import no_right_context, other_names

FLAGS = ("transformers", "other_layers", "decoder", "attention", "causal_decoder", "bidirectional_unset", "mem_len",
         "mem_scope", "model_causal", "neighbours", "neighbours_scope", "chunk_context", "own", "chunk_right", "chunk_scope",
         "added", "window_field", "frame_budget", "frame_block", "model_chunks", "evict_budget", "prefix_pool", "prefix_scope")
# what a Stated says of its config, not its fields (a model's memory length, its own causal flag: memlen.py, reach.py,
# chunkahead.py read them alone; the fields of a transformers config its class defines nowhere: configread.py)
FIELDS = ("sliding_window", "window_size", "layer_types", "sliding_window_pattern", "sliding_window_layers",
          "attention_chunk_size", "is_causal", "causal", "bidirectional", "use_bidirectional_attention",
          "use_sliding_window", "max_window_layers", "no_rope_layers", "sliding_window_size",
          "attn_type", "attention_type",  # (SGLang's, vLLM's, AI Edge Torch's attention layers)
          "force_causal_mask", "waitk", "wait_k",  # (torch-to-nnef's export word that the model is causal; wait-k: across.py)
          "sliding_windows",  # (a streaming encoder's (left, right) window per layer: checks/sidewindows.py)
          "interleaved_attn_pattern",  # (Megatron's (local, global) layer counts of one period: Gemma 3 / 4 providers)
          "unmask_image", "attention_context_right")  # (Surya's: its image prefix seen both ways at prefill, to the eoi_token_id: eoiprefix.py)
ENCODER_TYPES = ("ENCODER_ONLY", "ENCODER")  # an attn_type that attends both ways (SGLang / vLLM AttentionType)
IMAGE_IDS = ("image_token_id", "image_token_index")  # kept beside the FIELDS a config states, never alone
PER_LAYER = ("sliding_window_pattern", "sliding_window_layers", "max_window_layers", "interleaved_attn_pattern")
RENAMED = (("sliding_window", "window_said"), ("sliding_window_layers", "layers_said"), ("sliding_window_pattern", "pattern_said"))
COUNTS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")
NUMBERS = ("layer_idx", "layer_id", "layer_index")  # a module's own 0-based layer number (trace/stated.py)
NAMES = ("config", "cfg", "args", "hparams", "hp", "params", "model_args", "model_config", "conf", "settings", "opt")
LIKE = ("config", "args", "param", "setting", "conf", "option")  # words of a config class's name
ATTENTION = ("head", "attn", "attention")  # words of a field name that say a config is about attention
GENERAL = ("causal", "bidirectional")  # fields an RNN's or a convolution's config may state as well
CONTEXT = ("context_left", "context_right", "left_context", "right_context", "past_horizon", "future_horizon",
           "left_chunks")  # how far a chunk's queries see past it: its chunk size is then a local window's block (Gemma 4 audio)
SLIDING = re.compile(r"(?:attn|attention|local)_sliding_window(?:_size)?")  # a sliding window a prefix says is the
# attention's: read as sliding_window_size
OTHER_LAYERS = ("every_n", "attention_layers", "attention_types", "block_type", "interval", "global_attn", "local_attn",
                "attn_types", "stride")  # per-layer fields read nowhere here: where one is set, layer kinds are unknown


@dataclass(frozen=True)
class Stated:
    """One config's fields, where it was found, and the module path whose calls it speaks for (None: every call)."""

    source: str  # "self.cfg of layers.0 (ModelConfig)", "hf_config (dict) at the top of prog.py"
    scope: str | None
    fields: dict  # FIELDS it states (value not None), "layers" (its layer count) and FLAGS


def transformers_config(value) -> bool:
    """A transformers config: its class derives from PretrainedConfig (PreTrainedConfig in transformers 5)."""
    return any(base.__name__ in ("PretrainedConfig", "PreTrainedConfig") for base in type(value).__mro__)


def config_like(value, named: bool = False) -> bool:
    """A value that may be a config: a dict with str keys, a dataclass instance, a namespace, a transformers config, an
    object of a class named like one, or any object a module keeps under a config's name (`named`)."""
    if isinstance(value, dict):
        return True
    if isinstance(value, type) or callable(value) and not hasattr(value, "__dict__"):
        return False
    kind = type(value)
    if dataclasses.is_dataclass(value) or kind.__name__ in ("SimpleNamespace", "Namespace") or \
            read(value, "_fields", MISSING) is not MISSING:
        return True
    if transformers_config(value):
        return True
    return (hasattr(value, "__dict__") or hasattr(kind, "__slots__")) and (
        named or any(word in kind.__name__.lower() for word in LIKE))


def fields_of(value) -> dict:
    """The FIELDS a config states (None values left out), its layer count, whether it is transformers' and whether it
    has a per-layer field read nowhere here; {} where it states none of FIELDS."""
    if isinstance(value, dict):
        items = {k: v for k, v in value.items() if isinstance(k, str)}
    else:
        try:
            items = {**class_fields(value), **vars(value)}  # (class attributes a config of the program's states)
        except TypeError:  # (slots, a named tuple: its fields read one by one below)
            names = read(value, "_fields", ())
            items = {name: read(value, name) for name in (*COUNTS, *(names if isinstance(names, tuple) else ()))}
        for name in FIELDS:  # (a transformers config maps some names: attribute_map; a dataclass may use slots)
            if name not in items:
                found = read(value, name, MISSING)  # (never the program's __getattr__: `read`)
                if found is not MISSING:
                    items[name] = found
    found = {name: items[name] for name in FIELDS if items.get(name) is not None}
    if "sliding_window_size" not in found:  # (the attention's window under a prefix that names it: mlx-audio's
        # Voxtral codec `attn_sliding_window_size`)
        named = next((name for name in items if isinstance(name, str) and SLIDING.fullmatch(name)
                      and type(items[name]) is int), None)
        if named is not None:
            found["sliding_window_size"], found["window_field"] = items[named], named
    other_names(items, found, transformers_config(value) and read(value, "model_type", None))  # (Transformer-XL's
    # mem_len, llama.cpp's n_swa and swa_layers, ModernBERT's local_attention: fieldnames.py)
    text = items.get("text_config")
    unset = _bidirectional_unset(value, items, text)
    if unset is not None:
        return {**_fields_besides(value, items, text, found), "bidirectional_unset": unset}
    return _fields_besides(value, items, text, found)


def _bidirectional_unset(value, items: dict, text) -> dict | None:
    """{"image_token_id", "model"} where a config of the program's own (not transformers') states an image token id and,
    on itself or its text config, `use_bidirectional_attention` set to None: Gemma 4's word that its image tokens are
    causal (only "vision" makes them bidirectional: transformers' modeling_gemma4.py 2476), read by checks/spans.py
    where the model is Gemma 4."""
    if transformers_config(value):
        return None
    image = next((items[n] for n in IMAGE_IDS if isinstance(items.get(n), int) and not isinstance(items[n], bool)), None)
    if image is None:
        return None
    inner = {}
    if text is not None and text is not value:
        try:
            inner = dict(text) if isinstance(text, dict) else dict(vars(text))
        except TypeError:
            inner = {}
    holder = items if "use_bidirectional_attention" in items else inner
    if "use_bidirectional_attention" not in holder or holder["use_bidirectional_attention"] is not None:
        return None
    model = " ".join(str(x) for x in (items.get("model_type"), inner.get("model_type"), type(value).__name__,
                                      type(text).__name__) if x)
    return {"image_token_id": image, "model": model}


def _fields_besides(value, items: dict, text, found: dict) -> dict:
    """fields_of's reading once `found` (FIELDS with a value) is known."""
    if not found and text is not None and text is not value and not transformers_config(value):
        inner = fields_of(text) if isinstance(text, dict) or config_like(text, named=True) else {}
        if inner:  # (a composite config of the program's own: its text config's fields speak for the language model)
            image = next((items[n] for n in IMAGE_IDS if isinstance(items.get(n), int)), None)
            return {**inner, **({"image_token_id": image} if image is not None and "image_token_id" not in inner else {})}
    decoder_only = items.get("is_decoder") is True and not items.get("is_encoder_decoder")  # (a causal LM's: decoders.py)
    for name in ("attn_type", "attention_type"):  # an Enum kept as its name (AttentionType.ENCODER_ONLY)
        if name in found:
            found[name] = str(getattr(found[name], "name", found[name])).upper()
    if not found and not decoder_only:
        return {}
    found["causal_decoder"] = decoder_only
    image = next((items[n] for n in IMAGE_IDS if isinstance(items.get(n), int) and not isinstance(items[n], bool)), None)
    if image is not None:  # (where images sit in the ids: checks/spans.py, with use_bidirectional_attention)
        found["image_token_id"] = image
    eoi = items.get("eoi_token_id", read(value, "eoi_token_id")) if found.get("unmask_image") is True else None
    if isinstance(eoi, int) and not isinstance(eoi, bool):  # (where that prefix ends in the ids: eoiprefix.py)
        found["eoi_token_id"] = eoi
    for name in COUNTS:
        if isinstance(items.get(name), int):
            found["layers"] = items[name]
            break
    found["transformers"] = transformers_config(value)
    if found["transformers"]:
        found.pop("window_size", None)  # (transformers' attention reads sliding_window; a window_size is a vision window)
        found["added"] = _added(value, [name for name in found if name in FIELDS])  # (the program's own: classfields.py)
    found["attention"] = any(word in name.lower() for name in items if isinstance(name, str) for word in ATTENTION)
    found["decoder"] = bool(items.get("is_decoder") or items.get("is_encoder_decoder"))  # whose is_causal is a part's
    found["other_layers"] = any(any(word in name for word in OTHER_LAYERS) and "conv" not in name  # (a convolution's
                                # strides are no attention layer's kind: Voxtral's `decoder_convs_strides_str`)
                                and items[name] not in (None, False, 0, [], ())
                                for name in items if isinstance(name, str))
    found["chunk_context"] = any(any(word in name for word in CONTEXT) and items[name] is not None and items[name] is not False
                                 for name in items if isinstance(name, str))
    if isinstance(found.get("layer_types"), tuple):
        found["layer_types"] = list(found["layer_types"])
    return found


class Intent:
    """The fields stated for one call, merged over the configs that speak for it; each field with its source."""

    def __init__(self, stated: list[Stated]):
        self.values: dict = {}
        self.sources: dict = {}
        dropped = set()
        numbered = [one for one in stated if "layer_number" in one.fields]
        deepest = max(numbered, key=lambda one: len(one.scope or ""), default=None)  # the innermost module's number
        self.layer = None if deepest is None else deepest.fields["layer_number"]
        own = max((one for one in stated if "layer_slides" in one.fields), key=lambda one: len(one.scope or ""), default=None)
        self.slides = None if own is None else (own.fields["layer_slides"], own.source)  # (trace/ownwindow.py)
        stated = [one for one in stated if "layer_number" not in one.fields and "layer_slides" not in one.fields]
        for one in stated:
            for name, value in one.fields.items():
                if name in FLAGS:
                    continue
                if name in self.values and not _same(self.values[name], value):
                    dropped.add(name)  # two configs that disagree: nothing expected of it
                self.values.setdefault(name, value)
                self.sources.setdefault(name, one.source)
        for name in dropped:
            del self.values[name]
        self.renamed = {"sliding_window_size": one.fields["window_field"] for one in stated  # (said by its own name)
                        if one.fields.get("window_field") and self.sources.get("sliding_window_size") == one.source}
        self.renamed.update({name: one.fields[said] for name, said in RENAMED for one in stated  # (said by another name)
                             if one.fields.get(said) and self.sources.get(name) == one.source})
        self.sources.update({said: self.sources[name] for name, said in self.renamed.items() if name in self.sources})
        self.transformers = any(one.fields.get("transformers") for one in stated)
        inner = max((one for one in stated if one.fields.get("transformers")), key=lambda one: len(one.scope or ""), default=None)
        self.added = set() if inner is None else {name for name in inner.fields.get("added", ()) if name in self.values
                                                  and self.sources[name] == inner.source}  # (the innermost config's)
        self.other_layers = any(one.fields.get("other_layers") for one in stated)
        self.chunk_context = any(one.fields.get("chunk_context") for one in stated)
        self.decoder = any(one.fields.get("decoder") for one in stated)
        self.attention = any(one.fields.get("attention") for one in stated)
        self.key = repr((sorted(self.values.items()), sorted(self.sources.items()), self.transformers,
                         self.other_layers, self.decoder, self.chunk_context, self.slides))  # (layers stated alike are judged once per mask)

    def __bool__(self) -> bool:
        return bool(self.values)

    def get(self, name: str):
        return self.values.get(name)

    def said(self, name: str) -> str:
        """`name=value` with where it was stated: "sliding_window=3 (hf_config (dict) at the top of prog.py)."""
        return f"{self.renamed.get(name, name)}={self.values[name]!r} ({self.sources[name]})"

    def _sliding_layers(self, layers) -> set | list | tuple:
        """sliding_window_layers as a set, made once: a list of 10^6 searched per layer took hours."""
        if getattr(self, "_sliding", None) is None:
            try:
                self._sliding = set(layers)
            except TypeError:  # (unhashable entries: searched as given)
                self._sliding = layers
        return self._sliding

    def window(self) -> tuple[int, str] | None:
        """(W, field) of the stated sliding window: sliding_window, else an int window_size (its count unsure)."""
        for name in ("sliding_window", "window_size"):
            value = self.values.get(name)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value, name
        value = self.values.get("sliding_window_size")  # SGLang's: the keys before the query (W - 1), -1 for none
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value + 1, "sliding_window_size"
        return None

    def bidirectional(self) -> str | None:
        """The field that states the attention bidirectional (is_causal=False, causal=False, bidirectional=True,
        use_bidirectional_attention=True or "all"); None where none does or they disagree."""
        said = {name: self.values[name] is (name in ("bidirectional", "use_bidirectional_attention"))
                for name in ("is_causal", "causal", "bidirectional", "use_bidirectional_attention")
                if isinstance(self.values.get(name), bool)}
        said.update({"use_bidirectional_attention": True} if self.values.get("use_bidirectional_attention") == "all" else {})
        for name in ("attn_type", "attention_type"):
            if isinstance(self.values.get(name), str) and name not in said:
                said[name] = self.values[name] in ENCODER_TYPES
        if not said or len(set(said.values())) > 1 or not next(iter(said.values())):
            return None
        return next((name for name in said if name not in GENERAL), next(iter(said)))

    def causal(self) -> str | None:
        """The field that states the attention causal (is_causal=True, causal=True, force_causal_mask=True,
        use_bidirectional_attention=False); None where none does, or one of them says False (they disagree)."""
        said = {name: self.values[name] for name in ("is_causal", "causal", "force_causal_mask")
                if isinstance(self.values.get(name), bool)}
        if isinstance(self.values.get("use_bidirectional_attention"), bool):  # (False: the causal model's own word)
            said["use_bidirectional_attention"] = not self.values["use_bidirectional_attention"]
        said.update(no_right_context(self.values))  # (Gemma 3n / 4 audio's attention_context_right=0: fieldnames.py)
        if not said or not all(said.values()) or self.bidirectional() is not None:
            return None
        return next((name for name in said if name not in GENERAL), next(iter(said)))

    def sure_both_ways(self) -> bool:
        """The bidirectional statement is about attention: is_causal or use_bidirectional_attention, or causal /
        bidirectional in a config that names attention fields (heads, attn); an RNN's `bidirectional` is not."""
        said = self.bidirectional()
        return said is not None and (said not in GENERAL or self.attention)

    def kind(self, index: int | None) -> tuple[str, str, bool] | None:
        """(sliding_attention | full_attention | chunked_attention, the field that says so, implicit) for layer
        `index` (None: a call of no numbered layer, whose kind is known where every layer's is the same)."""
        types = self.values.get("layer_types")
        if isinstance(types, list) and types:
            if index is None:
                return (str(types[0]), "layer_types", False) if len(set(map(str, types))) == 1 else None
            return (str(types[index]), f"layer_types[{index}]", False) if index < len(types) else None
        if self.other_layers:
            return None
        named = self._named_kind()
        if named is not None:
            return named
        window = self.window()
        sliding = window is not None and self.values.get("use_sliding_window", True) is not False
        pattern = self.values.get("sliding_window_pattern")
        if index is None and sliding and any(self.values.get(name) is not None for name in PER_LAYER):
            return None
        if sliding and isinstance(pattern, int) and not isinstance(pattern, bool) and pattern > 0:
            full = (index + 1) % pattern == 0  # transformers' Gemma 3 / Cohere2: every pattern-th layer is full
            return ("full_attention" if full else "sliding_attention"), self.renamed.get(
                "sliding_window_pattern") or f"sliding_window_pattern={pattern}", False
        period = self.values.get("interleaved_attn_pattern")  # (local, global): Megatron's `(n - 1) % sum < local`
        if sliding and isinstance(period, (list, tuple)) and len(period) == 2 and all(
                type(x) is int and x >= 0 for x in period) and sum(period) > 0:
            full = index % sum(period) >= period[0]
            return ("full_attention" if full else "sliding_attention"), f"interleaved_attn_pattern={tuple(period)}", False
        layers = self.values.get("sliding_window_layers")
        if sliding and isinstance(layers, (list, tuple)) and layers:
            if all(isinstance(x, bool) for x in layers):
                chosen = index < len(layers) and layers[index]
            else:
                chosen = index in self._sliding_layers(layers)
            return ("sliding_attention" if chosen else "full_attention"), self.renamed.get(
                "sliding_window_layers", "sliding_window_layers"), False
        most = self.values.get("max_window_layers")
        if sliding and self.slides is not None and not (self.transformers and isinstance(most, int)):
            # the layer's own word (its is_sliding, its sliding_window: trace/ownwindow.py) over sliding_window alone and
            # a max_window_layers the program's own code reads (Qwen's docs and transformers' once said it both ways)
            return ("sliding_attention" if self.slides[0] else "full_attention"), self.slides[1], False
        if sliding and isinstance(most, int) and (self.transformers or self.values.get("use_sliding_window") is True):
            kind = "sliding_attention" if index >= most else "full_attention"  # configuration_qwen2.py 87-91
            return kind, f"max_window_layers={most}", False
        if sliding:
            return "sliding_attention", f"{window[1]}={self.values[window[1]]}", not self.transformers
        chunk = self.values.get("attention_chunk_size")
        nope = self.values.get("no_rope_layers")
        if isinstance(chunk, int) and chunk > 0 and self.chunk_context:
            return None  # (a block of a local window that reaches past it: its context fields say how far, unread here)
        if isinstance(chunk, int) and chunk > 0 and isinstance(nope, (list, tuple)) and nope:
            if index is None:  # Llama 4: a layer with RoPE (no_rope_layers[i] = 1) is chunked, a NoPE one full
                return None  # (configuration_llama4.py, layer_types from no_rope_layers)
            kind = "chunked_attention" if index < len(nope) and nope[index] else "full_attention"
            return kind, f"no_rope_layers[{index}]", False
        if isinstance(chunk, int) and chunk > 0:
            return "chunked_attention", f"attention_chunk_size={chunk}", not self.transformers
        if self.values.get("use_sliding_window") is False:
            return "full_attention", "use_sliding_window=False", False
        return "full_attention", "no sliding_window, layer_types or attention_chunk_size", False

    def _named_kind(self) -> tuple[str, str, bool] | None:
        """The kind a layer's own attn_type names (AI Edge Torch's GLOBAL / LOCAL_SLIDING) where a window is stated."""
        for name in ("attn_type", "attention_type"):
            value = self.values.get(name)
            words = set(value.replace("-", "_").split("_")) if isinstance(value, str) and self.window() else set()
            if words & {"GLOBAL", "FULL", "SLIDING", "LOCAL"}:
                full = bool(words & {"GLOBAL", "FULL"})
                return ("full_attention" if full else "sliding_attention"), f"{name}={value}", False
        return None

    def says_full(self) -> bool:
        """Full layers stated outright (use_sliding_window=False, layer_types that name other kinds too), so that a
        window of any size on one contradicts it; not transformers' default layer_types of a model with no window."""
        types = self.values.get("layer_types")
        return self.values.get("use_sliding_window") is False or (
            isinstance(types, list) and any(str(kind) != "full_attention" for kind in types))


def said_by_another(fields: dict, others: list[dict]) -> bool:
    """Another config states every field `fields` states, with the same value, and more besides: `fields` adds nothing
    to it (vLLM's cache_config.sliding_window copied from the model's config, which states the layer_types too)."""
    said = {name: value for name, value in fields.items() if name not in FLAGS or value}  # (a flag False says nothing)
    return any(len(set(other) - set(FLAGS)) > len(set(said) - set(FLAGS)) and all(
        name in other and _same(value, other[name]) for name, value in said.items()) for other in others)


def stated_for(top, where: str | None) -> list[Stated]:
    """The configs that speak for a call at module path `where` made within `top`: those of modules at or above it,
    else (where no module of the model holds a config) the program's one config variable."""
    stated = getattr(top, "stated", ()) if top is not None else ()
    where = where or ""
    mine = [one for one in stated if one.scope is not None and (one.scope in ("", where) or where.startswith(one.scope + "."))]
    numbers = [one for one in mine if "layer_number" in one.fields or "own" in one.fields or "layer_slides" in one.fields]  # (trace/stated.py's _numbers
    # and _kinds: module attributes, which speak beside the configs)
    held = [one for one in stated if one.scope is not None and not {"layer_number", "own", "layer_slides"} & set(one.fields)]
    if held:
        return [one for one in mine if one not in numbers] + numbers
    return [one for one in stated if one.scope is None] + numbers


def intent(run, call) -> Intent:
    """The stated intent for one call of `run` (cached per model call and module path)."""
    top = run.top(call)
    stated = () if top is None else top.stated
    key = (id(stated), call.where)  # (the steps of one model share its tuple: trace/stated.py reads it once)
    cache = run.__dict__.setdefault("_intents", {})
    found = cache.get(key)
    if found is None or found[0] is not stated:
        found = cache[key] = (stated, Intent(stated_for(top, call.where)))
    return found[1]
