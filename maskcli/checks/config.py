"""What each layer's mask should be, read from the configs the program states its attention in (checks/intent.py).

A layer's kind: `layer_types[i]` where a config has them (transformers 5 fills them in every config's __init__: Qwen2's
from use_sliding_window and max_window_layers, configuration_qwen2.py lines 83-90); else a pattern (sliding_window_pattern,
sliding_window_layers, Qwen2's max_window_layers); else `sliding_window` (unless use_sliding_window is False) makes every
layer a sliding one, `attention_chunk_size` a chunked one. A config that states the attention bidirectional (is_causal=False,
causal=False, bidirectional=True, use_bidirectional_attention) makes full layers full and a window symmetric.

A rule here speaks only where the mask is exactly a specific wrong one (the window one key wider or narrower, plain
causal where the window or the chunks would cut, a window on a full layer, a one-sided window or a causal mask where the
config says both ways), compared per batch row on the real queries and keys only (the model call's attention_mask, else
the padding read off the mask: keypadding), so a rule that holds unpadded holds padded; a mask no such expression
rebuilds (image spans, documents) is left to the rules that can name it.
"""

from __future__ import annotations

import numpy as np

import maskcli.checks.bidirname as bidirname
import maskcli.checks.bothways as bothways
from maskcli.checks.context import Run, columns_are_positions, found_padding, keep, layer, queries
from maskcli.checks.intent import OTHER_LAYERS, Intent, Stated, fields_of, intent, transformers_config
from maskcli.checks.real import behind_cache, slack_dropped, trimmed
from maskcli.checks.registry import Rule
from maskcli.checks.sides import beside_encoder
from maskcli.keypadding import valid
from maskcli.text import Finding

COUNTS_QUERY = "sliding_window counts the query itself, FlashAttention's window_size=(W-1, 0)"


def layer_kind(config, index: int | None) -> tuple[str, str] | None:
    """(sliding_attention | full_attention | chunked_attention, the field that says so) for layer `index` of a config."""
    return None if index is None else layer_kinds(config, [index])[0]


def layer_kinds(config, indexes) -> list[tuple[str, str] | None]:
    """layer_kind of each of `indexes`, the config read once (10^6 layers read it 10^6 times: minutes); none from a
    config of the program's own with a layer pattern of its own (nanochat's window_pattern "SL", read by its model)."""
    fields = {} if config is None else fields_of(config)
    if config is None or (not fields and not transformers_config(config) and _own_pattern(config)):
        return [None] * len(indexes)
    return [None if found is None else found[:2] for found in map(Intent([Stated("config", "", fields)]).kind, indexes)]


def _own_pattern(config) -> bool:
    """The config sets a per-layer field read nowhere here (a `window_pattern`, intent.OTHER_LAYERS' words)."""
    try:
        items = vars(config) if not isinstance(config, dict) else config
    except TypeError:
        return False
    return any(isinstance(name, str) and any(word in name for word in ("pattern", *OTHER_LAYERS))
               and value not in (None, False, 0, "", [], ()) for name, value in items.items())


class Placed:
    """One call's cells with its query positions and the real queries and keys of each batch row."""

    def __init__(self, cells: np.ndarray, own: np.ndarray, real_q: np.ndarray, real_k: np.ndarray):
        self.cells, self.own, self.real_k = cells, own, real_k
        rows = real_k.shape[0]
        self.judged = (real_q[:, None, :, None] & real_k[:, None, None, :])  # (B, 1, Lq, Lk)
        self.seen = np.broadcast_to(cells, (max(rows, cells.shape[0]), *cells.shape[1:]))
        self.keys = np.arange(cells.shape[-1])
        self._held: dict = {}

    def holds(self, expression: str) -> bool:
        """The cells are `expression` on every real query and key of every batch row (padding left to other rules)."""
        if expression not in self._held:
            expected = np.broadcast_to(self._expected(expression), self.judged.shape)
            self._held[expression] = not ((self.seen != expected) & self.judged).any()
        return self._held[expression]

    def _expected(self, expression: str) -> np.ndarray:
        q, k = self.own[:, None], self.keys[None, :]
        name, _, size = expression.partition("(")
        size = min(int(size.rstrip(")")), 1 << 62) if size else 0  # (past every position: int64, not a config's 2**200)
        if name == "causal":
            return (k <= q)[None, None]
        if name == "full":
            return np.ones((1, 1, 1, 1), bool)
        if name == "window":
            return ((k <= q) & (k > q - size))[None, None]
        if name == "band":
            return (np.abs(q - k) < size)[None, None]
        if name == "ahead":  # every earlier key and `size` later ones (a window's back side lost)
            return (k <= q + size)[None, None]
        if name == "behind":  # `size` earlier keys and every later one (its front side lost)
            return (k >= q - size)[None, None]
        start = self.real_k.argmax(axis=1)[:, None, None]  # local: chunks from each row's first real token
        if name == "local@0":  # (chunks from column 0, whatever padding the row has)
            start = np.zeros_like(start)
        return ((k <= q)[None] & ((q[None] - start) // size == (k[None] - start) // size))[:, None]


def real(cells: np.ndarray, own: np.ndarray, given, batch: int | None = None,
         before=None) -> tuple[np.ndarray, np.ndarray]:
    """Bool (B, Lk) real keys and (B, Lq) real queries of each batch row: the model call's 2-D attention_mask `given`
    where it is one 0/1 row per batch row (`batch`: the call's) over the keys, else the padding read off the mask
    (keypadding) or, at a later step, what `before()` gives (real.behind_cache); a query is real where its key is."""
    rows, _, q_len, k_len = cells.shape
    if isinstance(given, np.ndarray) and given.ndim == 2 and given.shape == (batch or rows, k_len) and \
            rows in (1, given.shape[0]) and np.isin(given, (0, 1)).all():
        real_k = given != 0
    else:  # read off the mask; else with the query rows left out that see every key (as transformers unmasks a padding
        # query) or only their own (as a hand-written mask or-s in the diagonal)
        padding = found_padding(cells) or found_padding(cells & ~cells.all(axis=-1, keepdims=True))
        if not padding and own[-1] < k_len:
            itself = np.zeros(cells.shape[-2:], bool)
            itself[np.arange(q_len), own] = True
            padding = found_padding(cells & ~(cells == itself).all(axis=-1, keepdims=True))
        real_k = valid(padding, rows, k_len)
        carried = None if before is None else before()
        if carried is not None and carried.shape == (carried.shape[0], k_len) and carried.shape[0] in (1, rows):
            real_k = np.broadcast_to(carried, (rows, k_len))
    real_k = np.ascontiguousarray(real_k)
    inside = own < k_len
    real_q = np.ones((real_k.shape[0], q_len), bool)
    real_q[:, inside] = real_k[:, own[inside]]
    return real_k, real_q


def _placed(call, run: Run, cells) -> Placed | None:
    """How the call's queries sit among its keys and which are real; None where not known (ring slots, cross-attention)."""
    top = run.top(call)
    if call.details.get("slots") is not None or cells.shape[2] > cells.shape[3] or not columns_are_positions(call, top):
        return None
    own, given = queries(call, top), None if top is None else top.arguments.get("attention_mask")
    cells, own = slack_dropped(cells, own, given)
    real_k, real_q = real(cells, own, given, call.shape[0], lambda: behind_cache(run, call))
    return Placed(cells, own, real_q, real_k)


def _each_layer_call(run: Run) -> list:
    """(call, intent, its layer, (kind, field, implicit), placed) once per distinct mask, shape, placing and intent;
    made once per run (four rules read it), nothing where the program states no config."""
    held = run.__dict__.get("_layer_calls")
    if held is None:
        held = run.__dict__["_layer_calls"] = list(_layer_calls(run)) if any(top.stated for top in run.tops) else []
    return held


def _layer_calls(run: Run):
    done = set()
    for call in run.calls:
        if call.stored is None:
            continue
        stated = intent(run, call)
        index = _index(run, call, stated)
        kind = stated.kind(index) if stated else None
        if kind is None and not (stated and stated.bidirectional()):
            continue
        top = run.top(call)
        key = (call.mask, call.shape, kind and kind[0], stated.key, _padding(run, top),
               call.details.get("queries") and tuple(call.details["queries"]), tuple(queries(call, top)[[0, -1]]))
        if key in done:
            continue
        done.add(key)
        cells = keep(call)
        placed = None if cells is None else _placed(call, run, cells)
        if placed is not None:
            yield call, stated, index, kind, placed


def _padding(run: Run, top) -> bytes | None:
    """The model call's attention_mask as bytes, read once per model call (calls that share it share their placing)."""
    held = run.__dict__.setdefault("_padding", {})
    if id(top) not in held:
        given = None if top is None else top.arguments.get("attention_mask")
        held[id(top)] = given.tobytes() + bytes(str(given.shape), "ascii") if isinstance(given, np.ndarray) else None
    return held[id(top)]


def _index(run: Run, call, stated: Intent) -> int | None:
    """The call's layer: its module path's number, else its turn among the calls one line made in its model call where
    those are as many as the config's layers (a forward that loops over its layers and attends in its own body)."""
    hf = call.details.get("hf")
    if stated and stated.layer is not None and call.details.get("layer") is None \
            and not (isinstance(hf, dict) and isinstance(hf.get("layer_idx"), int)):
        return stated.layer  # the module's own layer_idx / layer_id (intent.py), over a number of its path
    index = layer(call)
    count = stated.get("layers") if stated else None
    if index is not None or not isinstance(count, int) or count < 2:
        return index
    turns = run.__dict__.setdefault("_turns", {})
    if not turns:
        seen: dict = {}
        for other in run.calls:
            key = (id(run.top(other)), other.where, other.details.get("caller"))
            turns[other.index] = (key, seen.get(key, 0))
            seen[key] = seen.get(key, 0) + 1
        run.__dict__["_made"] = seen
    key, turn = turns.get(call.index, (None, None))
    return turn if key is not None and run.__dict__["_made"][key] == count else None


def _layer(index, call) -> str:
    return f"layer {index}" if index is not None else call.where


def window(run: Run) -> list:
    """A sliding layer's mask against the stated window: one key wider or narrower, no window, one-sided."""
    found, missing, windowed = [], [], set()
    for call, stated, index, kind, placed in _each_layer_call(run):
        if kind is None or kind[0] != "sliding_attention" or stated.window() is None:
            continue
        size, name = stated.window()
        where, source = _layer(index, call), stated.said(name)
        judged = bothways.judged(stated, placed, size, where, source, kind)  # (a band, each side W)
        if judged is not None:
            both, lost, seen = judged
            found += [(call, finding) for finding in both]
            missing += [(call, index, kind, lost)] if lost is not None else []
            windowed.update([(source, index)] if seen else [])
            continue
        if placed.holds(f"window({size})") or name == "sliding_window_size" and placed.holds(f"window({size - 1})") \
                or call.details.get("module_not_causal") and placed.holds(f"window({size + 1})"):
            windowed.add((source, index))  # (sliding_window_size counts the query in LitGPT's and Keras-hub's, not SGLang's;
            continue  # a module that states itself not causal has a band's one side, |q - k| <= W: ModernBERT's, run causal)
        for other in (size + 1, size - 1):
            if other >= 1 and placed.holds(f"window({other})") and not placed.holds("causal"):
                # (a causal mask whose queries sit fewer than W + 1 positions in is window(W + 1) too: no window
                # shows there, and a full layer of a config that alternates is causal so)
                windowed.add((source, index))
                how = "wider" if other > size else "narrower"
                sure = name == "sliding_window"
                found.append((call, Finding("window-off-by-one", (
                    f"{where} sees window({other}), one key {how} than its config's window({size}) ({source}): an "
                    f"off-by-one ({'the window counts the query itself' if name in stated.renamed else COUNTS_QUERY})"
                    if sure else
                    f"{where} sees window({other}), one key {how} than the window({size}) its config states "
                    f"({source}): an off-by-one unless its window_size counts the keys before the query only"),
                    severity=None if sure else "suspicious", expected=f"window({size})", source=source)))
                break
        else:
            half = _half(placed, size)
            if half is not None:
                windowed.add((source, index))
                found.append((call, Finding("window-half-missing", (
                    f"{where} sees {half[0]}, but its config states a window of {size} ({source}): one side of the "
                    f"window holds and the other is unbounded ({half[1]})"), expected=f"band({size + 1}) or window({size})", source=source)))
                continue
            if placed.holds("causal") and not placed.holds(f"window({size})"):
                # a field named for the sliding window is the attention's, whether it counts the query or not: `size`
                # is already the wider reading (SGLang's sliding_window_size + 1), and the mask reaches past it
                sure = "sliding_window" in name
                missing.append((call, index, kind, Finding("window-missing", (
                    f"{where} is a sliding layer ({kind[1]}) but its mask is causal: queries see keys {size} or more "
                    f"positions back ({source})" + ("" if sure else ", unless its window_size is "
                    "not the attention's")), severity=None if sure else "suspicious",
                    expected=f"window({size})", source=source)))
    # sliding_window alone in a config not transformers': a layer without it is missing it where no layer has it, or
    # where this layer has it at another step (a prefill with the window, a decode step without)
    sources = {source for source, _ in windowed}
    from maskcli.checks.windowpaths import counted_both_ways  # (one config's window kept two ways by two paths)
    return found + counted_both_ways(_each_layer_call(run), _layer) + [(call, finding) for call, index, kind, finding in missing
                                            if not kind[2] or finding.source not in sources or (finding.source, index) in windowed]


def full_layers(run: Run) -> list:
    """A full-attention layer (by layer_types, a pattern or use_sliding_window=False) given a sliding window: the window
    read from the wrong field, or layer types hard-coded by index against the config's."""
    found = []
    for call, stated, index, kind, placed in _each_layer_call(run):
        if kind is None or kind[0] != "full_attention" or kind[1].startswith("no "):
            continue
        both = stated.bidirectional()
        if placed.holds("full" if both else "causal"):
            continue
        stated_size = stated.window()
        if stated_size is not None:
            sizes = [w for w in (stated_size[0], stated_size[0] + 1, stated_size[0] - 1) if w >= 1]
        elif stated.says_full() and not both:
            sizes = [w for w in (_widest(placed),) if w >= 1]  # none stated: any window contradicts (no key: no window)
        else:
            continue
        shapes = ("band", "window") if both else ("window",)
        if any(placed.holds(f"{shape}({w})") for shape in shapes for w in sizes if w < placed.cells.shape[-1]):
            said = stated.sources.get(_field(kind[1]), "")
            if stated_size is None and stated.get("use_sliding_window") is False and "use_sliding_window" not in kind[1]:
                said += f"; {stated.said('use_sliding_window')}"
            about = f"about {stated_size[0]}" if stated_size else f"{sizes[0]}"
            found.append((call, Finding("window-on-full-layer", (
                f"{_layer(index, call)} is a full-attention layer ({kind[1]}{f', {said}' if said else ''}) but its mask is a sliding window "
                f"of {about} keys: the window applied by the wrong layer types or the wrong way round"),
                expected="full" if both else "causal", source=f"{kind[1]} ({said})" if said else kind[1])))
    return found


def _half(placed: Placed, size: int) -> tuple[str, str] | None:
    """What a mask bounded on one side only by about `size` keys sees, and its likely cause, in words; None where it is not so (full,
    causal, a band or a window on both sides, or too short a sequence to tell)."""
    if placed.holds("full") or placed.holds("causal"):
        return None
    for other in (size, size - 1, size + 1):
        if other < 1 or other + 2 > placed.cells.shape[-1] or any(placed.holds(f"band({w})") for w in (other, other + 1)):
            continue
        if placed.holds(f"ahead({other})"):
            return (f"every earlier key and only the {other} keys after each query", "a window side given as a negative "
                    "number, which flash-attn reads as no limit?")
        if placed.holds(f"behind({other})"):
            return f"the {other} keys before each query and every later one", "the causal bound left out?"
    return None


def _widest(placed: Placed) -> int:
    """1 + the furthest a real query sees back: the window a windowed mask has."""
    seen = placed.seen & placed.judged & (placed.keys[None, None, None, :] <= placed.own[None, None, :, None])
    distance = placed.own[None, None, :, None] - placed.keys[None, None, None, :]
    return int(np.where(seen, distance, -1).max()) + 1


def _field(said: str) -> str:
    return said.split("[")[0].split("=")[0]


def chunks(run: Run) -> list:
    """A chunked layer (Llama 4's attention_chunk_size) whose mask is causal across the chunks, or chunks one off."""
    found, missing, chunked = [], [], set()
    for call, stated, index, kind, placed in _each_layer_call(run):
        size = stated.get("attention_chunk_size")
        if kind is None or kind[0] != "chunked_attention" or not isinstance(size, int) or size < 1 or trimmed(run, call) is not None:
            continue  # (and a front-trimmed cache: its chunks need positions there, rolled.py counts them)
        where, source = _layer(index, call), stated.said("attention_chunk_size")
        if placed.holds(f"local({size})"):
            chunked.add(source)
            continue
        if placed.holds("causal"):
            missing.append((call, kind, Finding("chunks-missing", (
                f"{where} is a chunked layer ({kind[1]}) but its mask is causal across chunks of {size} ({source})"),
                expected=f"local({size})", source=source)))
            continue
        if placed.holds(f"local@0({size})"):
            b = int(placed.real_k.argmax(axis=1).argmax())
            found.append((call, Finding("chunks-misaligned", (
                f"{where} is chunked by {size} from column 0, but batch row {b} is left-padded: its chunks should "
                f"start at its first real token, as its positions do ({source})"), expected=f"local({size})",
                source=source)))
            continue
        for other in (size + 1, size - 1):
            if other >= 1 and placed.holds(f"local({other})"):
                found.append((call, Finding("chunks-off-by-one", (
                    f"{where} is chunked by {other} positions, one {'more' if other > size else 'fewer'} than the "
                    f"attention_chunk_size={size} its config states ({source})"), expected=f"local({size})",
                    source=source)))
                break
    # attention_chunk_size alone in a config not transformers': a hand-written Llama 4 may keep some layers full with
    # nothing that says which, so a causal layer is missing its chunks only where no layer has them
    return found + [(call, finding) for call, kind, finding in missing if not (kind[2] and finding.source in chunked)]


def both_ways(run: Run) -> list:
    """A layer whose config states the attention bidirectional (an encoder, an embedding model) run causal."""
    found = []
    for call, stated, index, kind, placed in _each_layer_call(run):
        said = stated.bidirectional()
        if said is None or stated.decoder or placed.holds("full") or not placed.holds("causal") or beside_encoder(run, call) \
                or "(handed as " in call.details.get("module_causal", ""):  # (a per-call object's word: forwardflag.HANDED)
            continue
        size = stated.window()[0] if kind is not None and kind[0] == "sliding_attention" and stated.window() else 0
        if any(placed.holds(f"window({w})") for w in (size, size + 1, size - 1) if w >= 1):
            continue  # a one-sided window: window-one-sided says it
        source, sure = stated.said(said), stated.sure_both_ways()
        found.append((call, Finding("bidirectional-run-causal", (
            f"{_layer(index, call)} is run causal, but its config states the attention both ways ({source}): each token"
            f" should see the later ones too" + ("" if sure else f", unless {said} is said of another part (an RNN, a "
            f"convolution)")), severity=None if sure else "suspicious", expected="full", source=source)))
    return found


RULES = (
    Rule("window-off-by-one", "wrong", "steps", "a sliding layer whose window is one key wider or narrower than the "
         "sliding_window its config states (any config: transformers', a dataclass, a dict)", window),
    Rule("window-missing", "wrong", "steps", "a sliding layer (layer_types, a window pattern, sliding_window) whose "
         "mask has no window", window),
    Rule("window-half-missing", "wrong", "steps", "a layer with a stated window whose mask keeps that window on one "
         "side of each query only and sees every key on the other (flash-attn's negative window side)", window),
    Rule("window-one-sided", "wrong", "steps", "a sliding layer stated bidirectional whose window looks back only", window),
    Rule("window-on-full-layer", "wrong", "steps", "a full-attention layer given the sliding window (layer types read "
         "from the wrong field, or hard-coded by index against the config's)", full_layers),
    Rule("chunks-missing", "wrong", "steps", "a chunked layer (attention_chunk_size) whose mask is causal across "
         "chunks", chunks),
    Rule("chunks-off-by-one", "wrong", "steps", "a chunked layer whose chunks are one position longer or shorter "
         "than attention_chunk_size", chunks),
    Rule("chunks-misaligned", "wrong", "steps", "a chunked layer whose chunks start at column 0 of a left-padded "
         "row, not at its first real token (transformers' chunked_overlay)", chunks),
    Rule("bidirectional-run-causal", "wrong", "steps", "an encoder or embedding model whose config states the "
         "attention bidirectional (is_causal=False, bidirectional, use_bidirectional_attention) run causal",
         lambda run: both_ways(run) + bidirname.named_both(run)),
)
