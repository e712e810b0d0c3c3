"""Bidirectional spans given by the model call's token types: Gemma 3's images, PaliGemma's prefix, Gemma 4's vision.

These families turn the token types they are called with into block ids (-1 outside every span) and or
them onto the causal mask, so that the tokens of one span see each other both ways
(transformers/masking_utils.py:114-128 blockwise_overlay, or-ed at :997-1000 after the causal mask
function and before the padding the mask interface ands on):

- gemma3: `token_type_ids == 1` are image tokens, one span per run of them: an image does not see a later
  image (models/gemma3/modeling_gemma3.py:671-679 get_block_sequence_ids_for_mask); every layer, the
  sliding ones and-ed with `lookback(W)` after the or (:682-739 create_masks_for_vision_model);
- gemma4 with `use_bidirectional_attention="vision"`: `mm_token_type_ids` 1 (image) or 2 (video), one
  span per run; sliding layers only, its full layers stay causal (models/gemma4/modeling_gemma4.py:2143-2215,
  2476);
- paligemma: `token_type_ids == 0` (the image and the prompt) is one prefix span, the suffix (1) causal
  (models/paligemma/modeling_paligemma.py:240-243);
- molmo2: `mm_token_type_ids == 1`, every image and frame token in one span (models/molmo2/modeling_molmo2.py:860-862).

Only the cells above the diagonal are judged (a key later than its query), on real queries and keys
(the attention_mask's 1s): there the expectation is exactly "the same span" on every layer that gets the
spans (lookback(W) keeps every later key) and "nothing" on a causal one; a window, padding or the cache
below the diagonal are other rules'. A span cell a sliding layer leaves out W or more keys ahead is left
unjudged too (a symmetric window would cut it). Key columns must be positions and the token types must
cover every query: at a decode step Gemma 3 gets no token types (its prepare_inputs_for_generation,
modeling_gemma3.py:1016-1026), and a decode query's later keys are none anyway.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Callable

import numpy as np

from maskcli.checks import eoiprefix
from maskcli.checks.config import layer_kind
from maskcli.checks.context import Run, columns_are_positions, first_cell, keep, layer, queries
from maskcli.checks.intent import intent
from maskcli.checks.configread import text_part
from maskcli.checks.registry import Rule
from maskcli.checks.spandocs import by_document
from maskcli.checks.towers import in_tower
from maskcli.text import Finding

LONGEST = 40  # an expected expression longer than this is printed with blocks(...) (--json carries it whole)


def runs(is_span: np.ndarray) -> np.ndarray:
    """Int64 (B, L) block ids: 0, 1, ... for each run of True along a row, -1 elsewhere (get_block_sequence_ids_for_mask)."""
    before = np.zeros_like(is_span)
    before[:, 1:] = is_span[:, :-1]
    number = np.cumsum(is_span & ~before, axis=1) - 1
    return np.where(is_span, number, -1).astype(np.int64)


def one_span(is_span: np.ndarray) -> np.ndarray:
    """Int64 (B, L) block ids: 0 where True, -1 elsewhere (PaliGemma's prefix: torch.where(token_type_ids == 0, 0, -1))."""
    return np.where(is_span, 0, -1).astype(np.int64)


@dataclass(frozen=True)
class Family:
    argument: str  # the model call's argument that marks the spans
    spans: Callable[[np.ndarray], np.ndarray]  # its values (B, L) -> block ids (B, L), -1 outside every span
    what: str  # a span's name in a message
    outside: str  # a token outside every span
    layers: str  # "all", or the one layer type that gets the spans
    on: Callable = lambda text_config: True  # whether this config makes the spans bidirectional at all
    stated: bool = True  # the argument says the spans are bidirectional; else only where they are, and say which


FAMILIES = {
    "gemma3": Family("token_type_ids", lambda t: runs(t == 1), "image", "text", "all"),
    "gemma4": Family("mm_token_type_ids", lambda t: runs((t == 1) | (t == 2)), "image", "text", "sliding_attention",
                     lambda text: getattr(text, "use_bidirectional_attention", None) == "vision"),
    "paligemma": Family("token_type_ids", lambda t: one_span(t == 0), "prefix", "suffix", "all"),
    "molmo2": Family("mm_token_type_ids", lambda t: one_span(t == 1), "image", "text", "all"),
}


CONFIG_CLASSES = {"Gemma3Config": "gemma3", "Gemma4Config": "gemma4", "PaliGemmaConfig": "paligemma", "Molmo2Config": "molmo2"}


def model_type(config, top=None) -> str | None:
    """The family's model_type: its config's, its config class's name as transformers names it (CONFIG_CLASSES: a port's
    own class so named), else the model call's class named as transformers names the family's (Gemma3Model...)."""
    found = getattr(config, "model_type", None) or CONFIG_CLASSES.get(type(config).__name__)
    named = None if top is None or found is not None else top.arguments.get("module_class")
    return next((kind for prefix, kind in MODEL_CLASSES if named.startswith(prefix)), None) if named else found


MODEL_CLASSES = (("PaliGemma", "paligemma"), ("Gemma3", "gemma3"), ("Gemma4", "gemma4"), ("Molmo2", "molmo2"))


PREFIX = ("prefix_len", "prefix_lens", "prefix_length", "num_prefix_tokens")  # a prefix-LM's bidirectional prefix
IMAGES = ("image_mask", "image_positions", "pixel_positions", "num_image_tokens")  # where images are, not how seen


def _first_real(top, rows: int, length: int) -> np.ndarray:
    """Int64 (rows, 1): each row's first real token by the model call's attention_mask (0 without one)."""
    given = top.arguments.get("attention_mask")
    if isinstance(given, np.ndarray) and given.ndim == 2 and given.shape == (rows, length):
        return (np.cumsum(given, axis=1) == 0).sum(axis=1)[:, None]
    return np.zeros((rows, 1), dtype=np.int64)


def _stated(top, rows: int, length: int) -> tuple[Family, np.ndarray] | None:
    """A hand-written model call's spans (B, L) block ids: a prefix length (PaliGemma's prefix, counted from each row's
    first real token), or where its images are (an image mask, their positions, a count of image tokens first): one
    span per run of image tokens."""
    if not any(name in top.arguments for name in (*PREFIX, *IMAGES)):
        return None  # (most model calls: no spans stated)
    columns = np.arange(length)[None, :]
    first = _first_real(top, rows, length)
    for name in PREFIX:
        given = top.arguments.get(name)
        given = np.asarray(given) if isinstance(given, (int, np.ndarray)) else None
        if given is not None and given.size in (1, rows) and given.ndim <= 1:
            size = given.reshape(-1, 1)
            return Family(name, None, "prefix", "suffix", "all"), one_span((columns >= first) & (columns < first + size))
    for name in IMAGES:
        given = top.arguments.get(name)
        if name == "image_mask" and isinstance(given, np.ndarray) and given.shape == (rows, length):
            is_image = given != 0
        elif name in ("image_positions", "pixel_positions") and isinstance(given, np.ndarray) and given.ndim in (1, 2) \
                and given.size and 0 <= given.min() and given.max() < length:
            is_image = np.zeros((rows, length), dtype=bool)
            at = np.broadcast_to(given.reshape(-1 if given.ndim == 2 else 1, given.shape[-1]), (rows, given.shape[-1]))
            is_image[np.arange(rows)[:, None], at] = True
        elif name == "num_image_tokens" and isinstance(given, (int, np.ndarray)) and np.asarray(given).size == 1:
            is_image = (columns >= first) & (columns < first + int(np.asarray(given).reshape(-1)[0]))
        else:
            continue
        if is_image.any():
            return Family(name, None, "image", "text", "all", stated=False), runs(is_image)
    return None


def _family(top, rows: int = 0, length: int = 0) -> tuple[Family, np.ndarray] | None:
    """The family and its block ids (B, L) for this model call, where it is one of FAMILIES and was given its argument,
    else where it states its spans by another argument (_stated)."""
    config = None if top is None else top.config
    family = FAMILIES.get(model_type(config, top))
    if family is None:
        return None if top is None or not length else _stated(top, rows, length)
    if not family.on(text_part(config)):
        return None
    given = top.arguments.get(family.argument)
    if not isinstance(given, np.ndarray) or given.ndim != 2:
        return None
    return family, by_document(top, family.spans(given))  # (a packed row's documents cut its spans: spandocs.py)


def _real(top, ids: np.ndarray, cells: np.ndarray, length: int) -> np.ndarray:
    """Bool (B, length): the positions the attention_mask marks real, inside the token types; where the model call was
    handed no 2-D attention_mask (generate's 4-D masks for a static cache), the keys some query of the row sees (a
    padding key no query sees, and a padding query is where its own key is)."""
    rows = ids.shape[0]
    real = np.zeros((rows, length), dtype=bool)
    width = min(length, ids.shape[1])
    given = top.arguments.get("attention_mask")
    if isinstance(given, np.ndarray) and given.ndim == 2 and given.shape[0] in (1, rows):
        width = min(width, given.shape[1])
        real[:, :width] = np.broadcast_to(given[:, :width] == 1, (rows, width))
    else:
        seen = np.broadcast_to(cells.any(axis=(1, 2)), (rows, cells.shape[-1]))
        width = min(width, seen.shape[1])
        real[:, :width] = seen[:, :width]
    return real


def _at(ids: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """ids (B, L) read at positions, -1 past L (transformers pads block ids with -1: maybe_pad_block_sequence_ids)."""
    inside = positions < ids.shape[1]
    found = np.full((ids.shape[0], len(positions)), -1, dtype=np.int64)
    found[:, inside] = ids[:, positions[inside]]
    return found


STATED_IMAGES = Family("input_ids", None, "image", "text", "sliding_attention")  # (_by_image_id: Gemma 4's "vision")


def _image_ids_stated(top) -> bool:
    return any(one.fields.get("use_bidirectional_attention") == "vision" and "image_token_id" in one.fields
               for one in getattr(top, "stated", ()) or ())


GEMMA4 = re.compile(r"gemma[-_ ]?4", re.IGNORECASE)


def _images_causal(top) -> tuple[int, str] | None:
    """(image token id, where stated) of a Gemma 4 config of the program's own whose `use_bidirectional_attention` is
    None (intent.py's bidirectional_unset): transformers' Gemma 4 runs its image tokens causal then, so no span is
    bidirectional. Gemma 4 as the config names it (its model_type, its class) or the module holding it (its class)."""
    for one in getattr(top, "stated", ()) or ():
        unset = one.fields.get("bidirectional_unset")
        if isinstance(unset, dict) and GEMMA4.search(f"{unset.get('model', '')} {one.source}"):
            return unset["image_token_id"], one.source
    return None


def _by_causal_images(call, top) -> tuple[Family, np.ndarray] | None:
    """The image runs of a Gemma 4 whose config leaves use_bidirectional_attention None: spans no layer makes
    bidirectional (layers "none"), so an image token that sees a later one contradicts the config."""
    found = _images_causal(top)
    ids = top.arguments.get("input_ids")
    if isinstance(ids, np.ndarray) and ids.ndim == 1 and call.shape[0] == 1:
        ids = ids[None, :]
    if found is None or not isinstance(ids, np.ndarray) or ids.ndim != 2 or not (ids == found[0]).any():
        return None
    argument = f"use_bidirectional_attention=None ({found[1]}, a Gemma 4 with image_token_id={found[0]})"
    return Family(argument, None, "image", "text", "none"), runs(ids == found[0])


def _by_image_id(run: Run, call, top) -> tuple[Family, np.ndarray] | None:
    """Gemma 4's image spans where no transformers config names the family: the stated intent (a config of the
    program's own, its text config's `use_bidirectional_attention="vision"` beside the `image_token_id` it states:
    checks/intent.py) and the model call's input ids (B, L), or (L,) flattened as vLLM runs a batch of one: one span per
    run of the image token, bidirectional on the sliding layers."""
    said = intent(run, call)
    image = said.values.get("image_token_id")
    if said.values.get("use_bidirectional_attention") != "vision" or not isinstance(image, int):
        return None
    ids = top.arguments.get("input_ids")
    if isinstance(ids, np.ndarray) and ids.ndim == 1 and call.shape[0] == 1:
        ids = ids[None, :]
    if not isinstance(ids, np.ndarray) or ids.ndim != 2 or not (ids == image).any():
        return None
    source = said.sources.get("image_token_id", "")
    return replace(STATED_IMAGES, argument=f"input_ids at image_token_id={image} ({source})"), runs(ids == image)


def _spanned(run: Run):
    """(call, its model call, family, block ids, query positions) for each call whose later keys the token types judge."""
    if not any(model_type(top.config, top) in FAMILIES or any(name in top.arguments for name in (*PREFIX, *IMAGES))
               or _image_ids_stated(top) or _images_causal(top) or eoiprefix.stated(top) for top in run.tops):
        return  # no model call of the run gives spans (most runs stop here)
    shown = _shown_both_ways(run)
    for call in run.calls:
        top = run.top(call)
        family = _family(top, call.shape[0], _length(top, call))
        if family is None and top is not None and top.config is None and _image_ids_stated(top):
            family = _by_image_id(run, call, top)
        elif family is None and top is not None and _images_causal(top):  # (a config of its own: never transformers')
            family = _by_causal_images(call, top)
        if family is None and top is not None and eoiprefix.stated(top) and (said := eoiprefix.prefix(run, call, top)):
            family = Family(said[0], None, "prefix", "text", "all"), said[1]  # (Surya's image prefix, to its EOI token)
        if family is None or call.stored is None or in_tower(call):
            continue
        family, ids = family
        rows, _, q_len, k_len = call.shape
        if ids.shape[0] != rows or q_len > k_len or not columns_are_positions(call, top):
            continue
        if not family.stated and (id(top), _kind(run, call)) not in shown:
            continue  # images placed but not said bidirectional, and no mask of this kind shows them so (LLaVA: causal)
        own = queries(call, top)
        if own[-1] < ids.shape[1]:  # token types that cover every query (a decode step given the new ones only: not)
            yield call, top, family, ids, own


def _length(top, call) -> int:
    """The model call's sequence length: its attention_mask's or input ids', else the call's keys."""
    for name in ("attention_mask", "input_ids", "idx", "tokens"):
        given = None if top is None else top.arguments.get(name)
        if isinstance(given, np.ndarray) and given.ndim == 2:
            return int(given.shape[1])
    return int(call.shape[3])


def _kind(run: Run, call) -> str:
    found = layer_kind(text_part(run.config(call)), layer(call))
    return "all" if found is None else found[0]


def _shown_both_ways(run: Run) -> set:
    """(model call, layer kind) where a mask lets a real token of an image see a later token of the same image: the
    program's own word that its image spans are bidirectional there (for spans placed by an argument that does not
    say so)."""
    found = set()
    for call in run.calls:
        top = run.top(call)
        if top is None or call.stored is None or not any(name in top.arguments for name in IMAGES):
            continue
        family = _family(top, call.shape[0], _length(top, call))
        if family is None or family[0].stated or call.shape[2] < 2 or not columns_are_positions(call, top):
            continue
        ids, own = family[1], queries(call, top)
        cells = keep(call)
        if cells is None or cells.shape[0] not in (1, ids.shape[0]) or own[-1] >= ids.shape[1]:
            continue
        k_len = call.shape[3]
        q_ids, k_ids = _at(ids, own), _at(ids, np.arange(k_len))
        later = (np.arange(k_len)[None, :] > own[:, None])[None]
        same = (q_ids[:, :, None] == k_ids[:, None, :]) & (q_ids[:, :, None] >= 0)
        if (cells.any(axis=1) & later & same).any():
            found.add((id(top), _kind(run, call)))
    return found


def explained(run: Run) -> set[int]:
    """The calls whose keys after their queries the token types account for (a span seen both ways, a later key
    seen by a padding query): trace's sees-later suspicion is answered there, by the findings of this module or
    their absence."""
    return {call.index for call, *_ in _spanned(run)}


@dataclass
class _Layer:
    """One attention call judged: its model call, family, block ids, query positions, layer type and whether it gets
    the spans."""

    call: object
    top: object
    family: Family
    ids: np.ndarray
    own: np.ndarray
    kind: str
    spans: bool
    window: int | None

    def expected(self, row: int) -> str:
        """What this layer's mask should be for one batch row, as a maskcli expression (padding aside)."""
        ids = _at(self.ids, np.arange(self.call.shape[3]))[row]
        text = f"causal | blocks({','.join(map(str, ids.tolist()))})" if self.spans else "causal"
        if self.kind == "sliding_attention" and self.window:
            return f"({text}) & lookback({self.window})" if self.spans else f"window({self.window})"
        return text

    def name(self, block: int) -> str:
        if block < 0:
            return self.family.outside
        return self.family.what if self.family.what == "prefix" else f"{self.family.what} {int(block)}"

    def finding(self, code: str, bad: np.ndarray, said: Callable[[int, int, int], str], severity: str | None = None) -> tuple:
        """The finding at the first True of `bad` (B, Lq, Lk): `said` words that cell, the message adds the rest."""
        b, q, k = first_cell(bad)
        expected, source = self.expected(b), f"{self.family.argument} of {self.top.where}"
        index = layer(self.call)
        where = f"layer {index}" if index is not None else self.call.where
        shown = expected if len(expected) <= LONGEST else re.sub(r"blocks\([^)]*\)", "blocks(...)", expected)
        says = ("say" if self.family.argument.endswith("ids") else "says") if self.family.stated else \
            "place the images, seen both ways elsewhere in its masks, so"
        message = f"{where}, row {b}: {said(b, q, k)} ({int(bad.sum())} cells); {self.family.argument} {says} {shown}"
        if severity == "suspicious":
            message += " (if only the image tokens are bidirectional, each image a span of its own)"
        return self.call, Finding(code, message, severity, expected=expected, source=source, cell=(b, int(self.own[q]), k))


def check(run: Run) -> list:
    """Each layer's cells above the diagonal against the spans its model call's token types make bidirectional."""
    found, done = [], set()
    for call, top, family, ids, own in _spanned(run):
        text = text_part(top.config)
        kind = (layer_kind(text, layer(call)) or ("full_attention", ""))[0]
        window = getattr(text, "sliding_window", None)
        if family.argument.startswith("input_ids "):  # (placed by a config of the program's: the intent's kind, window)
            said = intent(run, call)
            kind = (said.kind(layer(call)) or ("full_attention", ""))[0]
            window = (said.window() or (None,))[0]
        key = (call.mask, call.shape, ids.tobytes(), own.tobytes(), kind)
        if key in done:
            continue
        done.add(key)
        cells = keep(call)
        if cells is not None and cells.shape[0] in (1, ids.shape[0]):
            spans = family.layers in ("all", kind)
            found += _judged(_Layer(call, top, family, ids, own, kind, spans, window if isinstance(window, int) else None),
                             cells)
    return found


def _judged(at: _Layer, cells: np.ndarray) -> list:
    keys, own = np.arange(at.call.shape[3]), at.own
    q_ids, k_ids = _at(at.ids, own), _at(at.ids, keys)
    real = _real(at.top, at.ids, cells, int(max(len(keys), own[-1] + 1)))
    judged = (keys[None, :] > own[:, None])[None] & real[:, own][:, :, None] & real[:, :len(keys)][:, None, :]
    same = (q_ids[:, :, None] == k_ids[:, None, :]) & (q_ids[:, :, None] >= 0) if at.spans else np.zeros_like(judged)
    reach = judged
    if at.kind == "sliding_attention" and at.window:
        reach = judged & (keys[None, None, :] - own[None, :, None] < at.window)  # a symmetric window may cut the rest
    leak = judged & np.broadcast_to(cells.any(axis=1), judged.shape) & ~same
    missing = reach & same & ~np.broadcast_to(cells.all(axis=1), judged.shape)
    found = []
    if leak.any():
        found.append(at.finding("span-leak", leak, lambda b, q, k: f"query {int(own[q])} ({at.name(q_ids[b, q])}) sees "
                                f"later key {k} ({at.name(k_ids[b, k])})", None if at.family.stated else "suspicious"))
    if missing.any():
        found.append(at.finding("span-not-bidirectional", missing, lambda b, q, k: f"query {int(own[q])} does not see "
                                f"later key {k} of its own {at.name(q_ids[b, q])}"))
    return found


RULES = (
    Rule("span-leak", "wrong", "steps", "a query that sees a later key outside its own bidirectional span (an image "
         "that sees the next image, a text or suffix token that sees ahead), the spans read from the model call's "
         "token_type_ids / mm_token_type_ids", check),
    Rule("span-not-bidirectional", "wrong", "steps", "a token of an image (Gemma 3, Gemma 4's sliding layers), of "
         "PaliGemma's prefix or of Surya's unmask_image prefix that does not see the later tokens of its own span", check),
)
