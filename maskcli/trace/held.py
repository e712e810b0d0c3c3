"""The padding the program's own frames hold at an attention call: a padding mask or the lengths of its batch.

Read at each call from the functions of the program on the stack (not torch's, maskcli's, nor the standard library's),
by variable name only (a code object's names are matched once; its locals are read only where one matches): a 2-D
mask of 0/1 or bools named as a padding mask is (so is a (B, 1, L) or (B, 1, 1, L) one of bools or integers named as
padding, a key row broadcast over the queries as OpenNMT's `tgt_pad_mask` is, read as its (B, L); or the diagonal of a (B, L, L) one
named as padding: each token's own cell), 1-D integer lengths, and 1-D relative lengths (each row's share of the padded length, the longest 1.0);
also 2-D token ids (`input_ids`, `idx`, `tokens`: kind "ids", read beside the mask the same function holds,
checks/tokens.py). checks/held.py says where the kernel's mask
lets real queries see what the program itself calls padding (a mask built, then never handed on: uniem#23).
"""

from __future__ import annotations

import os
import re
import sys
import sysconfig
from collections import UserDict

import numpy as np
import torch

from maskcli.trace.codes import ByCode
from maskcli.trace.toplevel import read_by
import maskcli.trace.pairedids as pairedids
import maskcli.trace.slicedheld as slicedheld

KEEP = re.compile(r"(?:^|_)attention_mask$|^mask$|^input_mask$")  # 1 = a real token
PAD = re.compile(r"(?:^|_)(?:key_)?padding_mask$|(?:^|_)pad_mask$|(?:^|_)is_pad$")  # True = padding
LENGTHS = re.compile(r"^(?!cu_|max_)(?:\w+_|[a-z])?(?:len|lens|lengths|seq_lens|seqlens|durations?)$")  # (ESPnet's `ilens`, `hlens`)
COLUMNS = re.compile(r"^(?!cu_|max_)\w+_lengths?$")  # (B, k) lengths, a column each: Sockeye's `valid_length`
# (total, prepended) pairs (checks/hiddenreal.py; kind "columns", which the rules reading 1-D lengths leave alone)
CELLS = re.compile(r"(?:^|_)chunk_masks?$")  # a streaming encoder's chunk mask (L, L) or (B, L, L): its polarity unsaid
POSITIONS = re.compile(r"^(?:position_ids|positions|pos_ids)$")  # (B, L) positions that restart: packed documents
IDS = re.compile(r"^(?:input_ids|idx|tokens)$")  # (B, L) token ids, read beside a mask the same frame holds (checks/tokens.py)
GRAPHS = re.compile(r"^(?:batch|index|batch_index|batch_idx|batch_vec|node_batch|graph_index|graph_ids?)$")  # PyG's node ->
# graph index of a mini-batch of graphs concatenated node after node (checks/graphs.py)
LEFT = re.compile(r"^(?:left_padding|left_pad|left_pads|seq_start_pos)$")  # each row's left padding, in keys: a batch
# cache's (mlx-lm); where each row's sequence starts in a left-padded batch (x-transformers' generate: t - prompt_lens)
CACHE = re.compile(r"^(?:cache|kv_cache|past_key_values?|prompt_cache)$")  # an object that may hold `left_padding`
HANDED = re.compile(r"^(?:attention_mask|attn_mask|mask)$")  # a bool mask over the cells, handed down: polarity unsaid
BATCHES = re.compile(r"^(?:batch|inputs|data|sample|example|features|observations?|tasks?)$"  # a dict of the batch's tensors
                     r"|^(?!model_)(?:\w+_)?(?:encodings?|encoded|tokenized|inputs|tokens)$")  # (or a tokenizer's output:
# Flux's `batch_encoding`, diffusers' `text_inputs`, a transformers BatchEncoding or a dict of the same entries)
# (LeRobot's `batch["action_is_pad"]`): its entries named as a padding mask are read as held (not `**kwargs` nor
# generate's `model_inputs`: a transformers forward's or generate's frame would be read at every call, for masks the
# model call is handed anyway)
MOST = 1 << 16  # cells of one held mask read at most (a batch's padding, not a sequence's cells)
FRAMES = 24

_NAMES = ByCode()  # code object -> the names of its variables that may hold padding (matched once per code), or
_OUTSIDE = object()  # for the code of torch, maskcli, the standard library: not the program's
_READ: dict = {}  # (id(tensor), name, code) -> (tensor, version, what it was read as): read once while unchanged


def _skipped() -> tuple[str, ...]:
    """torch's, maskcli's, the standard library's and the installed packages' folders: a venv's site-packages lies
    outside the standard library's (python's own install holds it inside), and a library's frames are no program's."""
    own = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    paths = sysconfig.get_paths()
    return tuple({os.path.dirname(torch.__file__), own, *(paths[k] for k in ("stdlib", "purelib", "platlib"))})


_SKIP: tuple = ()


def program_frames(frame, limit: int):
    """The program's own frames from `frame` outwards (torch's, maskcli's, the standard library's and `<...>` code left
    out), at most `limit` of them."""
    global _SKIP
    if not _SKIP:
        _SKIP = _skipped()
    searched = 0
    while frame is not None and searched < limit:
        name = frame.f_code.co_filename
        if not (name.startswith(_SKIP) or name.startswith("<")):
            searched += 1
            yield frame
        frame = frame.f_back


def names(code):
    """The names of `code`'s variables that may hold padding (matched once per code), or None for code that is not the
    program's (torch's, maskcli's, the standard library's, `<...>`)."""
    global _SKIP
    if not _SKIP:
        _SKIP = _skipped()
    found = _NAMES.get(code)
    if found is None and code.co_name == "<module>" and not code.co_filename.startswith((*_SKIP, "<")):
        # a script's top level: its globals named as the batch's lengths or its padding mask (a plain `mask` says
        # too little there alone: checks/heldscript.py reads one only where the token ids held beside agree with it)
        found = _NAMES.put(code, tuple(n for n in code.co_names if LENGTHS.search(n) or PAD.search(n) or KEEP.search(n)))
    if found is None:
        found = _NAMES.put(code, _OUTSIDE if code.co_filename.startswith(_SKIP) or code.co_filename.startswith("<") else
            tuple(n for n in code.co_varnames if KEEP.search(n) or PAD.search(n) or LENGTHS.search(n)
                  or CELLS.search(n) or POSITIONS.search(n) or IDS.search(n) or HANDED.search(n)
                  or GRAPHS.search(n) or LEFT.search(n) or CACHE.search(n) or BATCHES.search(n) or COLUMNS.search(n)))
    return None if found is _OUTSIDE else found


def padding(frames: list | None = None) -> list[dict] | None:
    """[{name, where, kind: keep | pad | lengths, rows: np.ndarray}] held by the program's frames now; None if none.
    `frames`: (frame, names()) of the program's first FRAMES frames, innermost first, where the call's stack was walked
    already (trace/walk.py); else they are found from the caller's frame."""
    if frames is None:
        frames = []
        frame = sys._getframe(1)
        while frame is not None and len(frames) < FRAMES:
            found = names(frame.f_code)
            if found is not None:
                frames.append((frame, found))
            frame = frame.f_back
    found, seen = [], set()
    innermost, outer = None, []  # (the function that made the call; cells masks built above it, handed to no function)
    for frame, held in frames:
        innermost = innermost or frame
        top, start = frame.f_code.co_name == "<module>", len(found)
        if held and top:  # (a script's globals: those its running statement reads, tagged "top": trace/toplevel.py)
            running = read_by(frame.f_code, frame.f_lineno)
            held = tuple(name for name in held if name in running)
        if held:
            code = frame.f_code
            variables = frame.f_locals
            batches = []
            for name in held:
                value = variables.get(name)
                if issubclass(type(value), torch.Tensor) and id(value) not in seen and not LEFT.search(name):
                    read = _read(name, value, code)
                    if read is not None or not COLUMNS.search(name):  # (lengths read as nothing under a column name may
                        seen.add(id(value))  # be under an outer one: Sockeye's `valid_length`; a mask's name claims it)
                    if read is not None and name in pairedids.PAIRS \
                            and pairedids.inner_other(name, value, variables, pairedids.between(frame)):
                        continue  # (a decoder mask of other tokens than those a function nearer the call holds)
                    if read is not None:
                        found.append(read)
                        if read["kind"] == "cells" and HANDED.search(name) and frame is not innermost \
                                and name not in code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]:
                            outer.append((read, value))
                elif type(value) in SEQUENCES and LENGTHS.search(name) and id(value) not in seen:
                    seen.add(id(value))
                    read = _lengths_given(name, value, code)
                    if read is not None:
                        found.append(read)
                elif isinstance(value, (dict, UserDict)) and BATCHES.search(name) and id(value) not in seen:
                    seen.add(id(value))
                    batches.append((name, value.data if isinstance(value, UserDict) else value))  # (read after the frame's variables: a tensor held by both is named
                    # as the variable that holds it)
                elif value is not None and (LEFT.search(name) or CACHE.search(name)):
                    read, source = _left(name, value, code)
                    if read is not None and source not in seen:
                        seen.add(source)
                        found.append(read)
            for name, value in batches:
                found.extend(read for read in _entries(name, value, code, seen) if not any(
                    read["name"] == f'{name}["{key}"]' and pairedids.inner_other(key, value[key], value, pairedids.between(frame))
                    for key in pairedids.PAIRS))
        if start and len(found) > start:
            found[start:] = [read for read in found[start:] if not _shadowed(read, found[:start])]
        if top:
            found[start:] = [dict(read, top=True) for read in found[start:]]
    if outer and _own_mask(innermost, {id(value) for _, value in outer}):
        found = [read for read in found if not any(read is o for o, _ in outer)]
        found += slicedheld.views(innermost, outer, HANDED)  # (a window of one of them, rows and columns apart)
    return found or None


SHADOWED = ("lengths", "keep", "pad")  # (rows of a batch each; a cells mask's one row is a broadcast, not a batch of one)


def _shadowed(read: dict, inner: list[dict]) -> bool:
    """Whether a function nearer the call holds padding of the same kind over fewer batch rows than `read` (a part of
    its batch, or a row run alone: Sockeye's beam search over each source alone inside main's loop over the batch):
    `read` is then another batch's, not this call's. (More rows nearer the call are routine: a batch folded with
    heads or pairs, AlphaFold's (b i) j pair mask beside its (b, j) one.)"""
    return read["kind"] in SHADOWED and any(
        other["kind"] == read["kind"] and len(other["rows"]) < len(read["rows"]) for other in inner)


def split_top(details: dict) -> None:
    """A script's top-level statement of its batch (reads tagged "top") moved from details["held_padding"] to
    details["held_top"]: only a mask that is its exact complement is read against it (checks/turned.py); the rules that
    read a function's padding as weaker evidence read none of it (a script's globals may be another sequence's).
    Positions that go down without restarting (kind "drops"), no padding, go to details["held_positions"]
    (checks/contextlater.py), a batch dict's lengths to details["batch_lengths"] (checks/heldlengths.py), multimodal
    rope ids (kind "mrope") to details["held_mrope"] (checks/repeated.py), a held mask's window handed with its rows
    and columns apart (kind "sliced") to details["held_sliced"] (trace/slicedheld.py: checks/slicedmask.py)."""
    _move(details, "held_positions", lambda read: read["kind"] == "drops")
    _move(details, "batch_lengths", lambda read: read["kind"] == "batch_lengths")
    _move(details, "held_present", lambda read: read["kind"] == "present")
    _move(details, "held_mrope", lambda read: read["kind"] == "mrope")
    _move(details, "held_sliced", lambda read: read["kind"] == "sliced")
    _move(details, "held_top", lambda read: read.get("top"))


def _move(details: dict, key: str, which) -> None:
    """The reads of details["held_padding"] that `which` picks, moved to details[key]."""
    moved = [read for read in details.get("held_padding", ()) if which(read)]
    if moved:
        details[key] = moved
        details["held_padding"] = [read for read in details["held_padding"] if not which(read)]
        if not details["held_padding"]:
            del details["held_padding"]


def _entries(name: str, batch: dict, code, seen: set) -> list[dict]:
    """The padding masks a dict of the batch's tensors holds under a padding mask's name (`batch["action_is_pad"]`),
    and its token ids (`input_ids`: a tokenizer's output, the ids that say which keys its mask pads), read as a variable
    of that name is (a plain "mask" entry is not: a loss mask as often); a dict of more than 64
    entries is not looked through. Its integer lengths (`batch["seq_lengths"]`: a row's padding, or the documents packed
    in one row) are kind "batch_lengths", kept apart from the padding (split_top: checks/heldlengths.py)."""
    found = []
    if len(batch) <= 64:
        present = batch.get("pad_mask_dict")
        if type(present) is dict and len(present) <= 64:  # (Octo's: each input, present in which rows: kind "present")
            found.extend(_present(name, present, code))
        for key, value in batch.items():
            lengths = type(key) is str and LENGTHS.search(key)
            if type(key) is str and key != "mask" and (KEEP.search(key) or PAD.search(key) or lengths or IDS.search(key)) \
                    and issubclass(type(value), torch.Tensor) \
                    and id(value) not in seen:
                seen.add(id(value))
                read = _read(key, value, code)
                if read is not None and (not lengths or read["kind"] == "lengths"):
                    found.append({**read, "name": f'{name}["{key}"]', **({"kind": "batch_lengths"} if lengths else {})})
    return found


def _present(name: str, flags: dict, code) -> list[dict]:
    """Each entry of a batch's `pad_mask_dict` (Octo's: input name -> (B,) bools, False where that row lacks the input)
    that marks one row at least absent and one present, as kind "present" (split_top moves them to
    details["held_present"]: checks/absentinput.py)."""
    found = []
    for key, value in flags.items():
        if type(key) is str and issubclass(type(value), torch.Tensor) and value.dim() == 1 and 2 <= value.numel() <= MOST \
                and (value.dtype == torch.bool or not value.is_floating_point()):
            rows = value.detach().cpu().numpy().astype(bool)
            if rows.any() and not rows.all():
                found.append({"kind": "present", "rows": rows, "name": f'{name}["pad_mask_dict"]["{key}"]',
                              "where": f"{code.co_name}() of {os.path.basename(code.co_filename)}"})
    return found


def _own_mask(frame, outer: set) -> bool:
    """The function that made the call was handed a mask of its own under one of HANDED's names, and none of the cells
    masks (ids in `outer`) its callers built and handed to no function on the way: such a mask is another call's (an
    encoder-decoder's forward() builds the decoder's causal `mask` while its encoder is handed the padding alone). One
    handed down and then replaced (Megatron-LM#7039's window over the caller's `mask`) is still read."""
    code, variables = frame.f_code, frame.f_locals
    arguments = code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]  # (one it built itself is not handed it)
    own = [variables.get(name) for name in arguments if HANDED.search(name) and isinstance(variables.get(name), torch.Tensor)]
    return bool(own) and all(id(value) not in outer for value in own)


def _read(name: str, value: torch.Tensor, code) -> dict | None:
    """What `value`, held under `name` by `code`'s frame, says (the same dict while the tensor is unchanged)."""
    key = (id(value), name, id(code))  # (the code's id: hashing the code object itself costs a microsecond)
    if value.is_inference():  # (made under torch.inference_mode: no version counter, so read afresh each time)
        return _described(name, value, code)
    held = _READ.get(key)
    if held is not None and held[0] is value and held[1] == value._version and held[3] is code:
        return held[2]
    read = _described(name, value, code)
    if len(_READ) > 256:
        _READ.pop(next(iter(_READ)))
    _READ[key] = (value, value._version, read, code)  # (the tensor and code held: their ids stay their own)
    return read


def _described(name: str, value: torch.Tensor, code) -> dict | None:
    """What `value`, held under `name` by `code`'s frame, says, read now."""
    try:
        read = _as_padding(name, value)
    except (Exception, SystemExit):  # noqa: BLE001 - a tensor that cannot be read here (meta, fake, sparse) holds no padding we can see
        read = None
    if read is not None:
        read = {**read, "name": name, "where": f"{code.co_name}() of {os.path.basename(code.co_filename)}"}
    return read


def _as_padding(name: str, value: torch.Tensor) -> dict | None:
    if value.device.type == "meta" or value.is_sparse or value.numel() > MOST or value.numel() == 0:
        return None
    if IDS.search(name):
        if value.dim() != 2 or value.is_floating_point() or value.dtype == torch.bool:
            return None
        return {"kind": "ids", "rows": value.detach().cpu().numpy().astype(np.int64)}
    if GRAPHS.search(name):
        return _graphs(value)
    if value.dim() == 1 and LENGTHS.search(name) and not value.is_floating_point() and value.dtype != torch.bool:
        return {"kind": "lengths", "rows": value.detach().cpu().numpy().astype(np.int64)}
    if value.dim() == 1 and LENGTHS.search(name) and value.is_floating_point() and value.numel() > 1:
        # relative lengths (SpeechBrain's `wav_lens`: each row's share of the padded length, the longest 1.0)
        rows = value.detach().cpu().numpy().astype(np.float64)
        return {"kind": "relative", "rows": rows} if rows.max() == 1.0 and 0 < rows.min() < 1 else None
    if POSITIONS.search(name) and value.dim() == 3 and value.shape[0] in (3, 4) and not value.is_floating_point() \
            and value.dtype != torch.bool and value.shape[2] > 1:  # multimodal rope ids (C, B, L): Qwen2-VL's (t, h, w)
        return {"kind": "mrope", "rows": value.detach().cpu().numpy().astype(np.int64)}  # (checks/repeated.py)
    if POSITIONS.search(name):
        if value.dim() != 2 or value.is_floating_point() or value.dtype == torch.bool or value.shape[1] < 2:
            return None
        rows = value.detach().cpu().numpy().astype(np.int64)
        if ((rows[:, 1:] == 0) & (rows[:, :-1] > 0)).any():
            return {"kind": "positions", "rows": rows}
        # positions that go down but never restart at 0: tokens gathered out of order (DFlash's sampled blocks, laid
        # [context | block] with the context at its own positions): details["held_positions"] (split_top)
        return {"kind": "drops", "rows": rows} if (rows[:, 1:] < rows[:, :-1]).any() else None
    if HANDED.search(name) and value.dtype == torch.bool and value.dim() == 4 and value.shape[1] == 1 \
            and value.shape[-2] > 1:  # (B, 1, Lq, Lk): one mask for every head
        return {"kind": "cells", "rows": value[:, 0].detach().cpu().numpy()}
    if HANDED.search(name) and value.dtype == torch.bool and value.dim() == 3 and value.shape[-1] == value.shape[-2] > 1:
        return {"kind": "cells", "rows": value.detach().cpu().numpy()}  # (B, L, L): a trainer's causal & padding mask
    if value.dim() == 2 and 2 <= value.shape[1] <= 4 and COLUMNS.search(name) and not value.is_floating_point() \
            and value.dtype != torch.bool:  # (B, k) lengths, a column each (checks/hiddenreal.py)
        return {"kind": "columns", "rows": value.detach().cpu().numpy().astype(np.int64)}
    if not (KEEP.search(name) or PAD.search(name) or LENGTHS.search(name) or CELLS.search(name) or POSITIONS.search(name)):
        return None  # (`attn_mask` is read as cells only: a 2-D one is a causal triangle as often as padding)
    if CELLS.search(name) and value.dim() in (2, 3) and value.shape[-1] > 1:
        cells = value.detach().cpu().numpy()
        return {"kind": "cells", "rows": cells.astype(bool)} if np.isin(cells, (0, 1)).all() else None
    if PAD.search(name) and value.dim() == 3 and value.shape[-1] == value.shape[-2] > 1:
        # (B, L, L) named as padding, True = hidden for padding: a token's own cell is hidden exactly where it is padding,
        # however its rows were laid (a key mask repeated over the queries, an outer product, or either side's)
        rows = value.diagonal(dim1=-2, dim2=-1).detach().cpu().numpy()
        return {"kind": "pad", "rows": rows.astype(bool)} if np.isin(rows, (0, 1)).all() else None
    if PAD.search(name) and value.dim() in (3, 4) and value.shape[1:-1] == (1,) * (value.dim() - 2) \
            and value.shape[-1] > 1 and not value.is_floating_point():  # (named as padding only: a (B, 1, 1, L) one
        # named as a keep mask is True = kept in HF and the Annotated Transformer, True = masked in Megatron and NeMo
        # (`attention_mask` [b, 1, sq, sk]); a float one is as often BERT's additive extended mask, 0 = kept
        value = value.reshape(value.shape[0], value.shape[-1])  # (B, 1, L) / (B, 1, 1, L): one key row for every query
    if value.dim() != 2 or LENGTHS.search(name) or CELLS.search(name):
        return None
    rows = value.detach().cpu().numpy()
    if not np.isin(rows, (0, 1)).all():
        return None
    return {"kind": "pad" if PAD.search(name) else "keep", "rows": rows.astype(bool)}


SEQUENCES = (np.ndarray, list, tuple)  # lengths held as these are read as a tensor's are (not their subclasses: a
# named tuple, a structured array say more than lengths)
NUMBERS = (int, float, np.integer, np.floating)


def _lengths_given(name: str, value, code) -> dict | None:
    """The batch's lengths held as a numpy array, a list or a tuple (the program's statement as a tensor of them is):
    kind "lengths" for 1-D whole numbers, "relative" for 1-D fractions whose longest is 1.0; None for anything else.
    Its size is asked first, so a huge one costs nothing; a list or tuple is converted by numpy (no Python loop here),
    its items plain numbers only (no tensors, no objects: those would run code of theirs)."""
    size = value.size if type(value) is np.ndarray else len(value)
    if size == 0 or size > MOST:
        return None
    try:
        if type(value) is not np.ndarray:
            if not all(isinstance(item, NUMBERS) and type(item) is not bool for item in (value[0], value[-1])):
                return None
            value = np.array(value)  # (still, whatever is in the middle: object dtype, or a ragged list's error)
        rows = value if value.ndim == 1 else None
    except (Exception, SystemExit):  # noqa: BLE001 - not a sequence of numbers: no lengths we can read
        return None
    if rows is None:
        return None
    if rows.dtype.kind in "iu":
        read = {"kind": "lengths", "rows": rows.astype(np.int64)}
    elif rows.dtype.kind == "f" and rows.size > 1 and np.isfinite(rows).all() and rows.max() == 1.0 and 0 < rows.min() < 1:
        read = {"kind": "relative", "rows": rows.astype(np.float64)}
    else:
        return None
    return {**read, "name": name, "where": f"{code.co_name}() of {os.path.basename(code.co_filename)}"}


def _left(name: str, value, code) -> tuple[dict | None, int]:
    """Each batch row's left padding in keys (kind "left"), held as `left_padding` (ints, a list or 1-D tensor) or as a
    batch cache's `left_padding` attribute (mlx-lm's BatchKVCache: the slots before it in each row are padding); one
    row at least unpadded and one padded, else None; and the id of what holds them (read once per call)."""
    source = value if LEFT.search(name) else getattr(value, "left_padding", None)
    if source is None or isinstance(source, (str, bytes)) or not isinstance(source, (torch.Tensor, list, tuple)):
        return None, 0
    try:
        rows = np.asarray(source.detach().cpu() if isinstance(source, torch.Tensor) else source)
    except Exception:  # noqa: BLE001 - not a sequence of numbers: no padding we can read
        return None, 0
    if rows.ndim != 1 or rows.size < 2 or rows.dtype.kind not in "iu" or rows.min() != 0 or rows.max() < 1:
        return None, 0
    said = name if LEFT.search(name) else f"{name}.left_padding"
    return {"kind": "left", "rows": rows.astype(np.int64), "name": said,
            "where": f"{code.co_name}() of {os.path.basename(code.co_filename)}"}, id(source)


def _graphs(value: torch.Tensor) -> dict | None:
    """A PyG batch vector (kind "graphs"): 1-D ints from 0 that rise by 0 or 1, two graphs at least and one of two nodes
    at least (not `arange`, nor a batch of token ids)."""
    if value.dim() != 1 or value.is_floating_point() or value.dtype == torch.bool or value.numel() < 3:
        return None
    rows = value.detach().cpu().numpy().astype(np.int64)
    steps = np.diff(rows)
    if rows[0] != 0 or rows[-1] < 1 or not np.isin(steps, (0, 1)).all() or not (steps == 0).any():
        return None
    return {"kind": "graphs", "rows": rows}
