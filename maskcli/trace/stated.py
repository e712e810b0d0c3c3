"""The configs a traced program states its attention in (maskcli.checks.intent), found once per outermost module.

Read at the first call of each outermost module and kept as fields only (nothing the program holds is kept or
changed): the config-like attributes of the module and every module under it (`self.config`, `self.cfg`, a
dataclass, a dict, or a config its class keeps), each for the calls at or under the module that holds it; else the
config-like variables of the program's own frames at that call (its main module's top level, the function that
built and called the model) and of the program's modules that define the model's classes, which speak for every
call where they are one config.
"""

from __future__ import annotations

import functools
import os
import sys
import sysconfig

import torch

from maskcli.checks.intent import NAMES, NUMBERS, Stated, said_by_another
from maskcli.checks.intent import config_like as _config_like
from maskcli.checks.intent import fields_of as _fields_of
from maskcli.trace.chunksizes import chunk_sizes
from maskcli.trace.configvars import config_named as _config_named
from maskcli.trace.configvars import json_object as _json_object
from maskcli.trace.configvars import same_fields as _same_fields
from maskcli.trace.framebudget import frame_blocks, frame_budget
from maskcli.trace.owndecoder import own_decoders
from maskcli.trace.ownwindow import own_windows
import maskcli.trace.prefixpool as prefixpool
import maskcli.trace.seqdrop as seqdrop

FRAMES = 12  # program frames searched for config variables (the call's own and its callers)
SKIP = ("_parameters", "_buffers", "_modules", "_forward_hooks", "_forward_pre_hooks", "_backward_hooks",
        "_state_dict_hooks")


def stated(module, path, cache: dict, places: list | None = None) -> tuple[Stated, ...]:
    """The Stated configs for an outermost module (`path(module)`: the prefix of its calls' `where`), read once.
    `places`: the program's frames as `frames()` kept them at the module's call, where this is read after it."""
    held = cache.get(id(module))
    if held is not None and held[0] is module:
        return held[1]
    found = _held(module, path)
    if not found:
        found = _variables(module, places=places)
    elif not any(_windowed(one.fields) for one in found):
        found += _built_from(module, places, found)
    found += _numbers(module, path)
    found += own_windows(module, path) + own_decoders(module, path)
    found += _kinds(module, path)
    found += _full_blocks(module, path) + _memory_lengths(module, path)
    found += _model_causal(module) + _neighbours(module, path) + prefixpool.stated(module, path)
    found += _chunk_right(module, path) + seqdrop.rates(module, path)
    found += padding_flags(module, places) + frame_budget(module, places) + frame_blocks(module, places)
    cache[id(module)] = (module, tuple(found))
    return cache[id(module)][1]


def config_like(value, named: bool = False) -> bool:
    """checks.intent.config_like on the program's object; False where reading it raises (a config whose __getattr__
    or a property raises something other than AttributeError: python runs the program, so trace must)."""
    try:
        return _config_like(value, named)
    except (Exception, SystemExit):  # noqa: BLE001 - the program's own code raising inside a read: not a config maskcli can read
        return False


def fields_of(value) -> dict:
    """checks.intent.fields_of on the program's object; {} (states nothing) where reading it raises."""
    try:
        return _fields_of(value)
    except (Exception, SystemExit):  # noqa: BLE001 - as config_like
        return {}


def _held(root, path) -> list[Stated]:
    """Each config once, at the highest module that holds it (a transformers model's every layer holds its own),
    modules visited parents first."""
    found, fields_by_id, scopes = [], {}, {}
    for module in root.modules():
        scope = path(module)
        kept = {name: value for name, value in vars(type(module)).items() if name in NAMES}  # (a config the class keeps)
        for name, value in [*kept.items(), *vars(module).items()]:
            if name in SKIP or name.startswith("__") or isinstance(value, (torch.nn.Module, torch.Tensor)):
                continue
            if scope is None or not config_like(value, named=name in NAMES):
                continue
            higher = scopes.get(id(value), ())
            if any(s == "" or scope == s or scope.startswith(s + ".") for s in higher):
                continue  # said already for this module and those under it
            if id(value) not in fields_by_id:
                fields_by_id[id(value)] = (value, fields_of(value))  # (the value held too: its id stays its own)
            fields = fields_by_id[id(value)][1]
            scopes[id(value)] = (*higher, scope)
            if fields:
                label = f"self.{name} of {scope or type(module).__name__} ({type(value).__name__})"
                found.append(Stated(label, scope, fields))
    return found


WINDOWS = ("sliding_window", "layer_types", "sliding_window_pattern", "sliding_window_layers", "max_window_layers",
           "use_sliding_window", "attention_chunk_size", "no_rope_layers", "sliding_window_size")
BUILT_FROM = (*WINDOWS, "layers", "transformers", "other_layers", "attention", "decoder", "causal_decoder", "chunk_context")


def _windowed(fields: dict) -> bool:
    """The fields state the layers' windows in a form checks.intent reads (an int window_size too; a (left, right)
    tuple is a kernel's convention, read by checks/handed.py instead)."""
    return any(name in fields for name in WINDOWS) or type(fields.get("window_size")) is int


def _built_from(root, places: list | None, held: list[Stated]) -> list[Stated]:
    """Where the model's own configs state no window (a provider built for a kernel, holding a (left, 0) window_size),
    the window fields of the one config the program's frames hold besides them: the config the model was built from
    (Megatron-Bridge's HF config), speaking for every call."""
    said = [one.fields for one in held]
    outer = [one for one in _variables(root, places=places, besides=said) if _windowed(one.fields)]
    return [Stated(f"{one.source}, the config the model was built from", "",
                   {name: value for name, value in one.fields.items() if name in BUILT_FROM}) for one in outer]


def _numbers(root, path) -> list[Stated]:
    """Each module's own layer number (HF's `self.layer_idx`, SGLang's `self.attn.layer_id`: on the module or a plain
    object it holds), for the calls at or under it: a layer called on its own, outside any numbered path, is still the
    layer its config's layer_types speak of."""
    found = []
    for module in root.modules():
        scope = path(module)
        if scope is None:
            continue
        held = [("self", vars(module))] + [
            (f"self.{name}", vars(value)) for name, value in list(vars(module).items())
            if name not in SKIP and not isinstance(value, (torch.nn.Module, torch.Tensor)) and hasattr(value, "__dict__")
            and not isinstance(value, type) and not callable(value)]
        for owner, attributes in held:
            name = next((n for n in NUMBERS if type(attributes.get(n)) is int), None)
            if name is not None:
                label = f"{owner}.{name}={attributes[name]} of {scope or type(module).__name__}"
                found.append(Stated(label, scope, {"layer_number": attributes[name]}))
                break
    return found


KINDS = ("attn_type", "attention_type")  # SGLang's / vLLM's attention layer's own AttentionType
BOTH_WAYS = "use_bidirectional_attention"  # a module's own copy of the config's field, as a bool
KIND_NAMES = ("ENCODER_ONLY", "ENCODER", "DECODER", "ENCODER_DECODER")  # (their words: GPT-Neo's "local" is no kind)


def _kinds(root, path) -> list[Stated]:
    """A module's own `attn_type` / `attention_type` among KIND_NAMES, an Enum's name or a str (SGLang's RadixAttention
    is an nn.Module built with `attn_type=AttentionType.ENCODER_ONLY`; vLLM's AttentionType holds str constants), and
    its own bool `use_bidirectional_attention`, for the calls at or under it; `own` marks it a module's attribute, not a config, so it hides no config variable of the
    program's (checks/intent.py's stated_for)."""
    found = []
    for module in root.modules():
        scope, own = path(module), vars(module)
        for name in KINDS:
            value = own.get(name)
            kind = getattr(value, "name", value)
            if scope is not None and isinstance(kind, str) and kind.upper() in KIND_NAMES:
                found.append(Stated(f"self.{name}={kind} of {scope or type(module).__name__}", scope,
                                    {name: kind.upper(), "own": True}))
                break
        value = own.get(BOTH_WAYS)  # (TEI's Qwen3Model copies the config's word, None read as False, onto itself)
        if scope is not None and isinstance(value, bool):
            found.append(Stated(f"self.{BOTH_WAYS}={value} of {scope or type(module).__name__}", scope,
                                {BOTH_WAYS: value, "own": True}))
    return found


FULL_BLOCKS = ("fullatt_block_indexes",)  # Qwen2.5-VL's vision tower: the blocks that attend over the whole image


def _full_blocks(root, path) -> list[Stated]:
    """A module's own list of its full-attention block numbers (vLLM's and cosmos-rl's Qwen2.5-VL vision tower copy
    `fullatt_block_indexes` from the config onto the module), for the calls under it (checks/fullblocks.py)."""
    found = []
    for module in root.modules():
        scope = path(module)
        value = vars(module).get(FULL_BLOCKS[0])
        if scope is not None and isinstance(value, (list, tuple)) and value and all(type(v) is int for v in value):
            found.append(Stated(f"self.{FULL_BLOCKS[0]}={list(value)} of {scope or type(module).__name__}", scope,
                                {FULL_BLOCKS[0]: tuple(value)}))
    return found


MEMORY = "mem_len"  # a recurrent-memory model's own memory length (Transformer-XL's, the Feedback Transformer's)


def _memory_lengths(root, path) -> list[Stated]:
    """A module's own int `mem_len`, for the calls under it (checks/memlen.py); none where any module of the model
    holds another memory count beside it (a compressed memory's `cmem_len`, memory key/values `num_mem_kv`: more keys
    than the memory the one length counts)."""
    found, other = [], False
    for module in root.modules():
        for name, value in vars(module).items():
            if type(value) is int and "mem" in name and name != MEMORY:
                other = True
        value, scope = vars(module).get(MEMORY), path(module)
        if type(value) is int and value > 0 and scope is not None:
            found.append(Stated(f"self.{MEMORY}={value} of {scope or type(module).__name__}", None,
                                {MEMORY: value, "mem_scope": scope}))  # (scope None: no config of the layers' kinds,
            # which would hide the program's own config variables from checks/intent.py's stated_for)
    return [] if other else found


NEIGHBOURS = ("num_nearest_neighbors", "num_neighbors", "n_neighbors")  # a k-nearest-neighbour attention's own k
BESIDES = ("radius", "cutoff", "adj", "sparse")  # words of another reason to hide a neighbour (valid_radius, adjacency)


def _neighbours(root, path) -> list[Stated]:
    """A module's own int k of NEIGHBOURS, for the calls under it (checks/neighbours.py), a finite `valid_radius` beside
    it (it hides the farthest only); none where it also holds `only_sparse_neighbors=True` or an adjacency."""
    found = []
    for module in root.modules():
        own, scope = vars(module), path(module)
        name = next((name for name in NEIGHBOURS if type(own.get(name)) is int and own[name] > 0), None)
        k = None if name is None else own[name]
        if k is None or scope is None:
            continue
        other = [n for n, value in own.items() if any(word in n for word in BESIDES)
                 and (value is True or type(value) in (int, float) and value not in (0, float("inf")))]
        if len(radius := [n for n in other if "radius" in n or "cutoff" in n]) == len(other):
            found.append(Stated(f"self.{name}={k} of {scope or type(module).__name__}", None,
                                {"neighbours": k, "neighbours_scope": scope, "neighbours_radius": radius}))
    return found


def _model_causal(root) -> list[Stated]:
    """The outermost module's own `causal` / `is_causal` = True (a language model that packs memory slots beside its
    tokens and builds its own mask: recurrent-memory-transformer's `self.causal`), as `model_causal` for its calls
    (checks/reach.py); its layers' own flags say how each kernel is called, not what the model is. False: the model
    states its attention both ways (checks/config.py's bidirectional-run-causal), a part of it that may be a decoder
    (cross-attention, nn.TransformerDecoder) said as `decoder`."""
    for name in ("causal", "is_causal"):
        if vars(root).get(name) is True:
            return [Stated(f"self.{name}=True of {type(root).__name__}", None,
                           {"model_causal": True, **chunk_sizes(root)})]
        if vars(root).get(name) is False:  # the model's own word that it attends both ways (LLaDA_Arithmetic#3's
            # TransformerModel(causal=False)), about attention where no convolution or RNN under it could be meant
            other = any(isinstance(m, (torch.nn.modules.conv._ConvNd, torch.nn.RNNBase)) for m in root.modules())
            decoder = any(isinstance(m, (torch.nn.TransformerDecoderLayer, torch.nn.TransformerDecoder)) for m in
                          root.modules()) or any(w in n for n, _ in root.named_modules() for w in ("cross", "encoder_attn"))
            return [Stated(f"self.{name}=False of {type(root).__name__}", "", {name: False, "own": True,
                                                                            "attention": not other, "decoder": decoder})]
    return []


CHUNK_SIZES = ("chunk_size_current", "chunk_size", "chunk_len", "chunk_length", "N_c")  # a streaming encoder's chunk
CHUNK_RIGHT = ("chunk_size_right", "right_chunk_size", "chunk_right", "N_r")  # and its right context (neural_sp's N_c, N_r)


def _chunk_right(root, path) -> list[Stated]:
    """A module's own int chunk size and the chunk's right context (neural_sp's `chunk_size_current`,
    `chunk_size_right`), for the calls under it (checks/chunkahead.py)."""
    for module in root.modules():
        own, scope = vars(module), path(module)
        size = next((own[n] for n in CHUNK_SIZES if type(own.get(n)) is int and own[n] > 0), None)
        name = next((n for n in CHUNK_RIGHT if type(own.get(n)) is int and own[n] > 0), None)
        if size is not None and name is not None and scope is not None:
            return [Stated(f"self.{name}={own[name]} of {scope or type(module).__name__}", None,
                           {"chunk_right": (size, own[name]), "chunk_scope": scope})]
    return []


PADDING_FLAGS = ("mask_pad_tokens", "mask_padding", "mask_pad", "use_padding_mask", "use_pad_mask")  # a wrapper's
# word on whether the padding of the model it holds is masked (mosaicml/diffusion's StableDiffusion.mask_pad_tokens)


def padding_flags(module, places: list | None) -> list[Stated]:
    """The bool PADDING_FLAGS of the modules in the program's frames at `module`'s call (a wrapper's `self`) that hold
    `module` under them: what the wrapper states of the padding of the model it calls (checks/padflag.py)."""
    found, seen = [], set()
    for where, variables in places or ():
        for value in list(variables.values()):
            if not issubclass(type(value), torch.nn.Module) or value is module or id(value) in seen:
                continue
            seen.add(id(value))
            flags = {n: v for n in PADDING_FLAGS if isinstance(v := vars(value).get(n), bool)}
            if flags and any(m is module for m in value.modules()):
                said = ", ".join(f"{n}={v}" for n, v in flags.items())
                found.append(Stated(f"self.{said} of {type(value).__name__} ({where})", None, flags))
    return found


def outside(tops: list, where: str, index: int, cache: dict) -> None:
    """Call `index`, made outside any module (an inference engine's backend called with its layer object, SGLang's
    RadixAttention), gets a Top of what the program's frames state: their one object or config that carries FIELDS,
    whatever its class is named (read once per call site); the next calls that state the same extend it."""
    from maskcli.checks.context import Top

    if where not in cache:
        cache[where] = tuple(_variables(anything=True, depth=3))
    said = cache[where]
    if not said:
        return
    last = tops[-1] if tops else None
    if last is not None and last.end == index and not last.arguments and last.stated == said:  # (sites that alternate)
        last.end = index + 1
    else:
        tops.append(Top(where, None, {}, index, index + 1, said))


@functools.cache
def _skipped() -> tuple[str, ...]:
    """Where frames and modules are not the program's: torch's, maskcli's, installed packages' and the standard library's."""
    own = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    libraries = (sysconfig.get_paths()[k] for k in ("stdlib", "purelib", "platlib"))
    return tuple({os.path.dirname(torch.__file__), own, *libraries})


def frames(depth: int = 1, frame=None) -> list[tuple[str, dict]]:
    """The program's frames from `depth` frames up on (1: the caller; at most FRAMES), or from `frame`, each as (where,
    a copy of its variables):
    what `_variables` reads, kept at a module's call so that the configs are read after the run, off its hot path."""
    skip = _skipped()
    places, frame = [], sys._getframe(depth) if frame is None else frame
    while frame is not None and len(places) < FRAMES:
        name = frame.f_code.co_filename
        if not name.startswith(skip) and not name.startswith("<"):
            code, file = frame.f_code.co_name, os.path.basename(name)
            places.append((f"at the top of {file}" if code == "<module>" else f"in {code}() of {file}", dict(frame.f_locals)))
        frame = frame.f_back
    return places


def _variables(root=None, anything: bool = False, depth: int = 1, places: list | None = None,
               besides: list | None = None) -> list[Stated]:
    """The program's one config variable: in its frames at this call (the function that built and called the model,
    its main module's top level), else at the top of the program's modules that define `root`'s classes (torch's,
    maskcli's, installed packages' and the standard library's left out); [] where there is none, or several that
    differ (nothing says which is the model's). `anything`: any object that carries the fields, whatever its class
    is named (a call made outside any module: an engine's layer object). `places`: the frames as `frames()` kept
    them, where this is read after the call."""
    skip = _skipped()
    places = frames(depth + 1) if places is None else list(places)
    for held in {} if root is None else {type(module).__module__: None for module in root.modules()}:
        module = sys.modules.get(held)
        name = getattr(module, "__file__", None) or ""
        if name and not name.startswith(skip):
            places.append((f"at the top of {os.path.basename(name)}", vars(module)))
    found, seen, plain, named = [], set(), [], []
    for where, variables in places:
        for variable, value in list(variables.items()):
            try:
                if _variable(variable, value, variables, where, anything, seen, besides, found):
                    plain.append(not anything or config_like(value))
                    named.append(_config_named(variable, value))
            except (Exception, SystemExit):  # noqa: BLE001 - an object whose every attribute raises (its __class__): it states nothing
                continue
    kept = [i for i, one in enumerate(found) if not said_by_another(one.fields, [other.fields for other in found])]
    found, plain, named = [found[i] for i in kept], [plain[i] for i in kept], [named[i] for i in kept]  # (a copy)
    distinct = _distinct(found)
    if len(distinct) > 1 and any(named):
        # a step's runtime objects that carry a field of the same name (vLLM's CommonAttentionMetadata `causal`, its
        # FlashAttentionMetadata `sliding_window` in the kernel's (W - 1, 0)) beside the one variable the program
        # names a config (`config = Config()`): the config is the statement, the metadata what the program did
        named_found = [one for one, is_named in zip(found, named) if is_named]
        if len(named_distinct := _distinct(named_found)) == 1:
            found, plain, distinct = named_found, [True] * len(named_found), named_distinct
    if len(distinct) > 1 and anything:
        # an engine's layer or backend object (taken only as `anything`) holds the window in its kernel's convention,
        # converted from the model's config (vLLM's FlashAttentionImpl: sliding_window = (W - 1, 0)): the one config
        # the program keeps as a config (a dict, a dataclass, a class named so) is the statement
        found = [one for one, config in zip(found, plain) if config]
        distinct = _distinct(found)
    return found[:1] if len(distinct) == 1 else []


def _distinct(found: list) -> set:
    """The different field sets among the Stated found (two copies of one config are one)."""
    return {repr(sorted((k, repr(v)) for k, v in one.fields.items())) for one in found}


def _variable(variable: str, value, variables: dict, where: str, anything: bool, seen: set, besides, found: list) -> bool:
    """One variable of `_variables`' places: appended to `found` where it is a config of its own (True then)."""
    if isinstance(value, str) and not variable.startswith("_"):
        value = _json_object(value)  # (a checkpoint's config.json kept as its text)
        if value is None:
            return False
    if id(value) in seen or variable.startswith("_") or not config_like(value, named=anything) \
            or anything and isinstance(value, (torch.nn.Module, torch.Tensor)):
        return False
    seen.add(id(value))
    fields = fields_of(value)
    if fields and not any(_same_fields(fields, other) for other in besides or ()):  # (a config modules hold)
        if any(word in variable.lower() for word in ("attn", "attend", "attention")):
            fields = {**fields, "attention": True}  # (its own name says it is the attention's: `attend_kwargs`)
        kind = "JSON text" if isinstance(variables.get(variable), str) else type(value).__name__
        found.append(Stated(f"{variable} ({kind}) {where}", None, fields))
        return True
    return False
