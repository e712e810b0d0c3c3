"""The outermost module calls of a traced program (a model's forward, once per generate step), kept for the checks.

Each keeps the module's `config` (a Hugging Face model's, or any module's attribute of that name), the arguments that
say where tokens are, as small numpy arrays, and the range of attention calls it made (maskcli.checks.context.Top).
Nothing the program computes changes: the arguments are read, never held."""

from __future__ import annotations

import inspect
import os
import re
import weakref

import numpy as np
import torch

from maskcli.checks.context import STARTS, Top  # (STARTS: the first query's position as an int)
from maskcli.checks.intent import StaticView, dynamic, read
from maskcli.trace.causalarg import causal_arg
from maskcli.trace.constants import main_constants
from maskcli.trace.embedids import embed_ids, float_mask
from maskcli.trace.fieldids import field_ids
from maskcli.trace.handedcells import handed_cells
from maskcli.trace.handedshapes import handed_shapes
from maskcli.trace.held import program_frames
from maskcli.trace.heldids import held_ids
from maskcli.trace.labelids import shifted_labels
from maskcli.trace.modules import signature_or_none as _signature
from maskcli.trace.padded import MOST, batch_object, input_mask, lengths_over, nested_ids, padded_input  # (MOST: elements of one argument kept, the one limit)
from maskcli.trace.samplefields import sample_fields
from maskcli.trace.samplerows import sample_rows
from maskcli.trace.targetmap import target_mapping
from maskcli.trace.targetside import beside
from maskcli.trace.tiles import zero_units
from maskcli.trace.tokentypes import token_types
from maskcli.trace.tokenids import token_ids as _token_ids
from maskcli.trace.framebudget import video_input
from maskcli.trace.zeromemory import zero_memory
import maskcli.trace.pairedids as pairedids

ARGUMENTS = ("attention_mask", "position_ids", "cache_position", "input_pos", "token_type_ids", "mm_token_type_ids",
             "cu_seq_lens_q", "cu_seq_lens_k", "cu_seqlens", "seq_idx",
             "segment_ids",  # (each token's packed document, as JAX stacks name it: checks/varlen.py)
             "decoder_segment_ids", "encoder_segment_ids",  # (T5X's and MaxText's, 0 = padding: checks/real.py)
             "cu_seqlens_q", "cu_seqlens_k", "cumulative_seqlens_q", "cumulative_seqlens_k",  # flash's, transformers' CB
             "cu_window_seqlens",  # (Qwen2.5-VL's vision window segments beside its image ones: checks/fullblocks.py)
             "grid_thw", "image_grid_thw", "video_grid_thw",  # a vision tower's items, (t, h, w) patches each: checks/items.py
             # what else states where tokens are, as hand-written models name it (checks/real.py, tree.py, spans.py):
             "input_ids", "idx", "tokens", "token_ids", "inputs", "decoder_input_ids", "positions", "pos", "lengths", "seq_lens", "seq_lengths", "input_lengths", "key_padding_mask",
             "padding_mask", "pad_mask", "mask", "input_mask", "tree_parents", "retrieve_indices", "tree_position_ids", "position_offsets",
             "lang_x",  # (OpenFlamingo's and Otter's text ids beside their media: checks/media.py)
             "media_locations",  # (where a Flamingo text places its media, True at each media token: checks/mediarows.py)
             "image_mask", "image_token_mask", "image_positions", "pixel_positions", "prefix_len", "prefix_lens", "prefix_length",
             "num_prefix_tokens", "num_image_tokens", "waitk", "wait_k", "global_attention_mask",  # (LED's: globaltokens.py)
             # the encoder's padding a cross-attention must keep (checks/memory.py) and the decoder's own:
             "encoder_attention_mask", "memory_key_padding_mask", "decoder_attention_mask", "tgt_key_padding_mask",
             # a hand-written seq2seq model's two sides, each with its own pad id (checks/sides.py):
             "src", "source", "src_ids", "source_ids", "trg", "tgt", "target", "trg_ids", "tgt_ids", "target_ids",
             "input_src", "src_tokens", "source_tokens", "src_seq", "input_trg", "input_tgt", "trg_tokens", "tgt_tokens",
             "src_input", "trg_input", "tgt_input", "target_input",  # (JoeyNMT's teacher-forced decoder input)
             "source_seq", "trg_seq", "tgt_seq", "target_seq")
LISTS = ("cu_seqlens_q", "cu_seqlens_k", "cumulative_seqlens_q", "cumulative_seqlens_k")  # kept from a list of ints too
SCALARS = ("prefix_len", "prefix_length", "num_prefix_tokens", "num_image_tokens", "waitk", "wait_k")  # kept as ints too
PATCHES = ("patch_attention_mask", "patch_attn_mask")  # a vision tower's real patches: Idefics2's (B, H/p, W/p), kept flat
_NAMED = ARGUMENTS + PATCHES


def _given(module, args: tuple, kwargs: dict) -> tuple[inspect.Signature | None, dict]:
    """The module's forward signature and the arguments of one call to it by name (positional ones too)."""
    given = dict(kwargs)
    signature = _signature(type(module))
    if signature is not None and args:
        names = [name for name in signature.parameters if name != "self"]
        given.update({name: value for name, value in zip(names, args) if name not in given})
    return signature, given


def withheld(module, args: tuple, kwargs: dict, caller) -> dict:
    """What `_withheld` reads of one outermost call, from the program's frames from `caller` (the frame that made the
    call) outward: read as the call runs (outer.py), since its Top is made later, when those frames hold other values
    or have returned."""
    from maskcli.trace.scored import scored  # (a trainer's completion mask; a trajectory's step mask: steppad.py)
    from maskcli.trace.memslots import memory_slots  # (a memory's slots, its mask and its zeros: memflip.py)
    from maskcli.trace.positionrow import padding_row  # (a position table's padding row: checks/positionrow.py)
    from maskcli.trace.steppad import step_padding
    signature, given = _given(module, args, kwargs)
    return {**_withheld(signature, given, caller), **scored(given, caller), **step_padding(given, caller),
            **memory_slots(given), **padding_row(module, given, caller)}


def top(where: str, module, args: tuple, kwargs: dict, first: int, end: int, stated: tuple = (),
        held: dict | None = None, cached: dict | None = None) -> Top:
    """The Top of one outermost call: its config and the position arguments it was given (positional ones by name).
    `held`: what was read of the program's frames as the call ran (`withheld`); `cached`: what `cache_read` read of
    its cache as the call ended, where the Top is made later (trace/later.py)."""
    signature, given = _given(module, args, kwargs)
    given, found = {**given, **batch_object(signature, given)}, {}  # (a batch object's tensor and lengths: padded.py)
    for name in _NAMED:
        value = given.get(name)
        if value is None:  # (most of these names are not the call's: one lookup each, every step)
            continue
        if name in PATCHES and issubclass(type(value), torch.Tensor) and value.dim() == 3:
            value = value.flatten(1)
        if issubclass(type(value), torch.Tensor) and value.dim() <= 2 and value.numel() <= MOST and value.device.type != "meta" \
                and (value.dtype == torch.bool or not value.is_floating_point()):
            found[name] = _int64(value)
        elif name == "position_ids" and issubclass(type(value), torch.Tensor) and value.dim() == 3 and value.shape[0] in (3, 4) \
                and value.numel() <= MOST and not value.is_floating_point():  # (multimodal rope's (C, B, L): kept apart)
            found["mrope_position_ids"] = _int64(value)  # (checks/arguments.py's flat_positions reads them)
        elif isinstance(value, int) and not isinstance(value, bool) and name in SCALARS:
            found[name] = value
        elif name in LISTS and isinstance(value, (list, tuple)) and 1 < len(value) <= MOST \
                and all(isinstance(x, int) or issubclass(type(x), torch.Tensor) and x.dim() == 0 for x in value):
            found[name] = np.array([int(x) for x in value], dtype=np.int64)  # (continuous batching keeps them as lists)
    if "segment_ids" not in found and "seq_idx" not in found:
        found.update(_held_segments(given) or _decoder_segments(given))
    found = token_types(module, found)  # (a segment_ids argument the model embeds as token types: BERT's)
    slots = next((given[n] for n in ("input_positions", "kv_write_indices") if issubclass(type(given.get(n)), torch.Tensor)), None)
    if slots is not None and slots.dim() == 1 and 0 < slots.numel() <= MOST and slots.dtype in (torch.int64, torch.int32) \
            and slots.device.type != "meta" and "cache_position" not in found:  # (gemma_pytorch's `input_positions`:
        found.setdefault("input_pos", _int64(slots))  # its queries' cache slots, as torchtune's `input_pos`)
    for name in ("cache_position", "input_pos"):  # slots of a cache: one below 0 is none (the program's own nonsense,
        held_slots = found.get(name)  # which its model may never read): it states no place for the queries
        if isinstance(held_slots, np.ndarray) and held_slots.size and held_slots.min() < 0:
            del found[name]
    for name in STARTS:
        value = given.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            found[name] = value
    if type(given.get("is_causal")) is bool and not type(module).__module__.startswith("torch.") and not any(
            issubclass(type(v), torch.Tensor) and v.dim() >= 2 and v.shape[-1] == v.shape[-2] > 1
            and (v.dtype == torch.bool or v.is_floating_point()) for v in given.values()):
        found["is_causal"] = given["is_causal"]  # (the caller's word, beside no (L, L) mask of its own: callcausal.py)
    found.update(_first_ids(signature, given, found) or field_ids(signature, given, found, MOST))  # (or (B, L, F))
    found.update(held_ids(given, module, found))  # (ids inside a batch dict, `model(x)`: trace/heldids.py)
    found.update(_token_ids(module))
    found.update(nested_ids(given, found))  # (ids of more axes beside that pad id: RETRO's neighbours)
    found.update(_zeros(given, found))
    found.update(embed_ids(given, found))  # (tokens handed as embeddings: one id each, checks/runalone.py)
    found.update(float_mask(given, found))  # (a 0/1 float attention_mask, kept apart: checks/runalone.py)
    found.update({**_images(given), **zero_units(given)})  # (and an image input's tiles that are 0: checks/tiles.py)
    found.update({**target_mapping(given), **shifted_labels(given)})  # (XLNet's query stream; the labels a loss shifts)
    if any(name in found for name in CLASSED):  # (the tower's family, how it attends a video: checks/items.py; a port's
        found["module_class"] = type(module).__name__  # class named as its family's, whose token types say: spans.py)
    found.update(padded_input(given))
    found.update(sample_fields(given))  # (a batch of features, one value per sample among them: checks/batchaxis.py)
    found.update(input_mask(given))  # (a mask named for an input beside it: checks/plainpad.py)
    found.update(zero_memory(given))  # (a memory input whose padding is zeroed: checks/zeromemory.py)
    found.update(video_input(given))  # (a video latent's shape: checks/frameblocks.py)
    found.update(handed_cells(given))  # (a (B, L, L) mask the call was handed: checks/handedcausal.py)
    found.update(causal_arg(given))  # (a mask it was handed named causal: checks/namedcausal.py)
    found.update(lengths_over(signature, given))
    found.update(main_constants())  # (a window and layer kinds kept as the script's constants: checks/layerwindow.py)
    found.update({"convs": convs} if (convs := _convs(module)) else {})  # (its time-mixing convolutions: convpad.py)
    found.update(held or {})
    if "pad_id" not in found and any(name in found for name in ("input_ids", "idx", "tokens", "first_ids")):
        from maskcli.trace.tokenizer import tokenizer

        found.update(tokenizer(module))  # (the tokenizer the program's frames hold: its pad id and side)
    if type(module).__name__.endswith("ForCausalLM"):  # the model states itself a causal LM (checks/causal_lm.py)
        found["causal_lm"] = type(module).__name__
    found.update(cache_read(given) if cached is None else cached)
    config = getattr(module, "config", None)
    if config is not None and dynamic(config):  # (its __getattr__ is the program's: the checks read it statically)
        config = StaticView(config)
    return Top(where, config, found, first, end, stated, rows=sample_rows(given),  # (each row of its tensors: a sample
               state_writes=found.pop("state_writes", None),  # run alone, checks/batchaxis.py; outer.py's count)
               shapes=handed_shapes(given))  # (the shapes of what it was handed: a new batch's length, checks/restarted.py)


def cache_read(given: dict) -> dict:
    """What a call's cache holds as the call ends: its class, the tokens it holds, a static cache's slots."""
    found, cache = {}, given.get("cache", given.get("past_key_values"))  # (transformers 5.24's keyword; the older name)
    if cache is not None:
        found["past_key_values"] = type(cache).__name__
        held = _held(cache)
        if held is not None:
            found["cache_length"] = held
        sizes = _static_sizes(cache)
        if sizes:
            found["cache_slots"] = sizes
    return found if cache is not None or given.get("use_cache") is not False else {"no_cache": True}  # (stated: none)


SEGMENTS = ("segment_ids", "seq_idx")  # fields of an argument object that name each token's packed document


def _held_segments(given: dict) -> dict:
    """{"segment_ids": int (B, L), "segments_held_by": the argument's name}: each token's packed document, held as a field of an argument the model call was handed
    (Levanter's `AttentionMask(is_causal=True, segment_ids=...)`, a batch dict's "segment_ids"), where the call was not
    handed the tensor itself. Read statically (intent.read: never the program's __getattr__); tensors, modules and
    plain values are passed over, so most calls read nothing."""
    for name, value in given.items():
        if value is None or isinstance(value, (torch.Tensor, torch.nn.Module, int, float, str, bool, list, tuple)):
            continue
        for field in SEGMENTS:
            held = dict.get(value, field) if isinstance(value, dict) else read(value, field)  # (a dict subclass's get unread)
            if isinstance(held, torch.Tensor) and held.dim() == 2 and held.numel() <= MOST and not held.is_floating_point() \
                    and held.dtype != torch.bool and held.device.type != "meta":
                return {"segment_ids": held.detach().cpu().numpy().astype(np.int64), "segments_held_by": name}
    return {}


def _decoder_segments(given: dict) -> dict:
    """{"segment_ids": int (B, L), "segments_named": "decoder_segment_ids"}: a decoder-only model's packed documents as
    Flax stacks name them (MaxText's and T5X's `decoder_segment_ids`, 0 for padding), where the call is handed nothing
    of an encoder (`encoder_*`: then the ids are one side's of two, and that side's self-attention is not told apart)."""
    value = given.get("decoder_segment_ids")
    if not isinstance(value, torch.Tensor) or value.dim() != 2 or value.numel() > MOST or value.is_floating_point() \
            or value.dtype == torch.bool or value.device.type == "meta" \
            or any(name.startswith("encoder_") and given[name] is not None for name in given):
        return {}
    return {"segment_ids": _int64(value), "segments_named": "decoder_segment_ids"}


def _int64(value: torch.Tensor) -> np.ndarray:
    """An integer or bool tensor's cells as an int64 array of their own (a copy: the program may change it later). On
    the CPU one view and one copy: detach, cpu, numpy and astype are four calls of tens of microseconds each, cold."""
    if value.is_cpu and type(value) is torch.Tensor and not value.requires_grad:
        return np.array(value.numpy(), dtype=np.int64)
    return value.detach().cpu().numpy().astype(np.int64)


IDS = ("input_ids", "idx", "tokens", "src", "source", "src_ids", "source_ids", "src_tokens", "input_src")
CLASSED = ("image_shapes", "grid_thw", "image_grid_thw", "video_grid_thw", "token_type_ids", "mm_token_type_ids")


def _first_ids(signature, given: dict, found: dict) -> dict:
    """{"first_ids": (name, (B, L) ids)} of a hand-written `forward(self, x)` whose ids none of IDS names; "first_ids_beside": a
    seq2seq's target ids beside them (trace/targetside.py: the first ids are then the source's)."""
    if signature is None or any(name in found for name in IDS):
        return {}
    name = next((n for n in signature.parameters if n != "self"), None)
    value = given.get(name)
    if issubclass(type(value), torch.Tensor) and value.dim() == 2 and not value.is_floating_point() \
            and value.dtype != torch.bool and value.numel() <= MOST and value.device.type != "meta":
        return {"first_ids": (name, _int64(value)), **({"first_ids_beside": t} if (t := beside(signature.parameters, given, name)) else {})}
    return {}


_CONVS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
STRIDED = 16  # convolutions and poolings of one model read, in module order


def _convs(module) -> tuple:
    """The model's strided convolutions and poolings in module order (the order they are registered, as a speech
    encoder's subsampling stack runs them), each ((kernel, stride, padding, dilation, ceil) of its first two axes):
    how its frames are made of its samples (checks/subsampled.py). Read once per model."""
    try:
        return _CONVS[module]
    except (KeyError, TypeError):
        pass
    found = []
    for each in module.modules():
        if isinstance(each, (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.MaxPool1d, torch.nn.AvgPool1d,
                             torch.nn.MaxPool2d, torch.nn.AvgPool2d)):
            axes = []
            for axis in (0, 1):
                k, s, p, d = (getattr(each, name, 1) for name in ("kernel_size", "stride", "padding", "dilation"))
                k, s, p, d = (v if isinstance(v, int) else v[min(axis, len(v) - 1)] for v in (k, s, p, d))
                axes.append((int(k), int(s or k), int(p) if isinstance(p, int) else -1, int(d),
                             bool(getattr(each, "ceil_mode", False))))
            found.append(tuple(axes))
            if len(found) == STRIDED:
                break
    found = tuple(found)
    try:
        _CONVS[module] = found
    except TypeError:
        pass
    return found


def _images(given: dict) -> dict:
    """{"image_shapes": (name, ((H, W), ...))}: an argument that is a list of two or more images, (C, H, W) or
    (1, C, H, W) float tensors (eole's and pixtral's `images`): the items a vision tower may concatenate (checks/items.py)."""
    for name, value in given.items():
        if isinstance(value, (list, tuple)) and 1 < len(value) <= 256 and all(
                isinstance(x, torch.Tensor) and x.is_floating_point() and (x.dim() == 3 or x.dim() == 4 and x.shape[0] == 1)
                for x in value):
            return {"image_shapes": (name, tuple((int(x.shape[-2]), int(x.shape[-1])) for x in value))}
    return {}


def _zeros(given: dict, found: dict) -> dict:
    """{"zeros": (name, bool (B, L))}: where the call's float input is exactly 0, beside a (B, L) padding mask (checks/tokens.py)."""
    shapes = {found[n].shape for n in ("padding_mask", "key_padding_mask", "pad_mask", "attention_mask")
              if isinstance(found.get(n), np.ndarray) and found[n].ndim == 2}
    for name, value in given.items():
        if issubclass(type(value), torch.Tensor) and value.is_floating_point() and value.dim() in (2, 3) \
                and tuple(value.shape[:2]) in shapes and value.numel() <= MOST and value.device.type != "meta":
            zero = value.detach() == 0
            return {"zeros": (name, (zero if value.dim() == 2 else zero.all(-1)).cpu().numpy())}
    patches = next((found[n] for n in PATCHES if isinstance(found.get(n), np.ndarray) and found[n].ndim == 2), None)
    if patches is not None:  # images (B, C, H, W) with a mask over their patches: which patches are exactly 0
        for name, value in given.items():
            if issubclass(type(value), torch.Tensor) and value.is_floating_point() and value.dim() == 4 \
                    and value.shape[0] == patches.shape[0] and value.numel() <= MOST and value.device.type != "meta":
                zero = _zero_patches(value.detach(), patches.shape[1])
                return {} if zero is None else {"zeros": (name, zero)}
    return {}


def _zero_patches(images: torch.Tensor, count: int) -> np.ndarray | None:
    """Bool (B, count): the square patches of (B, C, H, W) images, row by row as a ViT's patch embedding flattens
    them, that are exactly 0 in every channel; None where `count` square patches do not tile H x W."""
    height, width = images.shape[-2:]
    side = int(round((height * width / count) ** 0.5)) if count else 0
    if side < 1 or height % side or width % side or (height // side) * (width // side) != count:
        return None
    zero = (images == 0).all(dim=1)  # (B, H, W)
    zero = zero.reshape(images.shape[0], height // side, side, width // side, side).all(dim=4).all(dim=2)
    return zero.reshape(images.shape[0], count).cpu().numpy()


# a mask of padded items a model takes (frames, images, audio, patches, key padding); not an attention mask (another
# side's, a decoder's: padding-ignored and memory.py read those), a loss, label or head mask, which mask no padding
MASK_PARAMETER = re.compile(r"^(?!.*(?:attention|attn|loss|label|labels|head|causal|lm)_)\w*?(?:frame|image|img|video|audio"
                            r"|speech|clip|patch|media|vision|visual|pixel|item|obs|feature|padding|pad|valid)s?_mask$")
# a decoder's own attention mask (HF's 1 = attend, 0 = padding), which generation code keeps beside the model's inputs
# and may never hand over (transformers#15556: BART's prepare_inputs_for_generation dropped `decoder_attention_mask`)
DECODER_MASK = re.compile(r"^decoder_attention_mask$")
WITHHELD_FRAMES = 4  # program frames read outward from the model call: its caller and theirs


def _withheld(signature, given: dict, frame) -> dict:
    """{"withheld": (name, where, int (B, N))}: a padding-like mask the model's forward takes as `name` (`frame_mask`,
    `image_mask`: a parameter named `*_mask`) that the call left at None while a function of the program that made
    the call holds a tensor of that very name, as a variable or as a dict's key (`batch["frame_mask"]`): 2-D, 0/1,
    some 0 (checks/withheld.py). Read only where such a parameter went unfilled; `frame`: the one that made the call."""
    if signature is None or frame is None:
        return {}
    names = [name for name in _mask_parameters(signature) if given.get(name) is None]
    if not names:
        return {}
    for n, frame in enumerate(program_frames(frame, WITHHELD_FRAMES)):
        code = frame.f_code
        # (a module's globals speak for no call, but the main module's own line that made this call: a generation loop)
        variables = frame.f_locals if code.co_name != "<module>" or n == 0 and frame.f_globals.get("__name__") == "__main__" \
            else {}
        for name in names:
            for held, holder in ((variables.get(name), variables),
                                 *((v.get(name), v) for v in variables.values() if isinstance(v, dict))):
                rows = _padding_like(held)
                if rows is not None and not pairedids.other_tokens(name, held, holder, given):
                    at = "the top" if code.co_name == "<module>" else f"{code.co_name}()"
                    return {"withheld": (name, f"{at} of {os.path.basename(code.co_filename)}", rows)}
    return {}


_MASKS: dict = {}  # id(signature) -> (signature, its parameters MASK_PARAMETER matches): matched once per forward


def _mask_parameters(signature) -> tuple:
    held = _MASKS.get(id(signature))
    if held is None or held[0] is not signature:
        held = _MASKS[id(signature)] = (signature, tuple(n for n in signature.parameters
                                                         if MASK_PARAMETER.match(n) or DECODER_MASK.match(n)))
    return held[1]


def _padding_like(held) -> np.ndarray | None:
    """Int (B, N) of a 2-D 0/1 tensor with some 0; None for anything else."""
    if not issubclass(type(held), torch.Tensor) or held.dim() != 2 or held.numel() > MOST or held.device.type == "meta" \
            or held.is_floating_point():
        return None
    rows = held.detach().cpu().numpy().astype(np.int64)
    return rows if np.isin(rows, (0, 1)).all() and (rows == 0).any() else None


def _held(cache) -> int | None:
    """The tokens a Hugging Face cache (or a dict kept as Flax's 'cache' collection: `cache_index`) holds once the call
    wrote its own (a static cache's written slots): transformers 5.24 passes no cache_position, and its generate
    hands a static cache's model call a 4-D mask over every slot (StaticLayer.get_seq_length, 502: cumulative_length)."""
    if isinstance(cache, dict):  # Flax's 'cache' collection as ports keep it: its `cache_index` counts the tokens written
        held = cache.get("cache_index")
        if issubclass(type(held), torch.Tensor) and held.dim() == 0 and not held.is_floating_point():
            held = int(held)
        return held if isinstance(held, int) and not isinstance(held, bool) and held >= 0 else None
    length = getattr(cache, "get_seq_length", None)
    if not callable(length):
        return None
    try:
        held = int(length())
    except (Exception, SystemExit):  # (a cache of the program's own whose method wants arguments: nothing read, nothing changed)
        return None
    return held if held >= 0 else None


def _static_sizes(cache) -> tuple[int, ...]:
    """The slot counts of a Hugging Face cache's static layers, each of which hands attention its whole buffer, slot j
    holding position j until it fills (cache_utils.py StaticLayer.update 462-492, get_mask_sizes 496-500;
    StaticSlidingWindowLayer keeps min(window, max_cache_len) slots, 539-541, and returns them all while not full,
    600-613). Read off `max_cache_len` of the layers that have one as an int (the static ones); () for any other."""
    if isinstance(cache, dict):  # (Flax's `cached_key`, (*batch, max_length, heads, depth): its slots along -3)
        key = cache.get("cached_key")
        return (int(key.shape[-3]),) if issubclass(type(key), torch.Tensor) and key.dim() >= 3 else ()
    layers = getattr(cache, "self_attention_cache", cache)  # (an encoder-decoder's: its decoder's own keys)
    found = {getattr(layer, "max_cache_len", None) for layer in getattr(layers, "layers", None) or ()}
    return tuple(sorted(size for size in found if isinstance(size, int) and size > 0))
