"""Cross-attention read against the encoder padding the model call states: no real decoder query sees a padded memory key.

The model call states which encoder tokens are real by `encoder_attention_mask` (1 = a real token, as
Hugging Face's decoders with cross-attention take it), `memory_key_padding_mask` (True = padding, as
nn.Transformer and nn.TransformerDecoder take it), or, for an encoder-decoder model (config
`is_encoder_decoder`), its `attention_mask`, which is the encoder's; handed none, its input ids at the pad id its
config states in a run at one end of each row (a padded batch fed without its mask: transformers-bart-pretrain#11,
real.stated's reading). A cross-attention call (context.crossing:
what the program states, or more queries than keys) whose keys are that many tokens must hide the padded ones from
every decoder query that attends at all; a batch row whose memory is all padding is left alone (a kernel
may unmask it to avoid NaN). Where the model call states none, the memory's encoder states it by its own
self-attention's mask (memturned.encoder_padding: a key padding mask, or a segment mask keeping real with real and
padding with padding, nari-labs/dia#230); a cross-attention softmax that masks nowhere is read against it too. The
self-attention side of padding is arguments.py's.
"""

from __future__ import annotations

import bisect

import numpy as np

from maskcli.checks.context import Run, _block, cross, crossing, first_cell, keep
from maskcli.checks.memturned import encoder_padding, own_key_ends
from maskcli.checks.real import stated
from maskcli.checks.registry import Rule
from maskcli.checks.tiles import tile_padding
from maskcli.text import Finding


def memory_padding(top, rows: int, length: int) -> tuple[np.ndarray, str] | None:
    """(bool (rows, length) real encoder tokens, the argument that says it), or None where the model call states none
    for `length` keys (or two that disagree)."""
    arguments, found = top.arguments, []
    names = [("encoder_attention_mask", True), ("memory_key_padding_mask", False)]
    if _seq2seq(top):
        names.append(("attention_mask", True))
    for name, ones_real in names:
        given = arguments.get(name)
        if isinstance(given, np.ndarray) and given.ndim == 2 and given.shape[1] == length and given.size \
                and given.shape[0] in (1, rows) and given.min() >= 0 and given.max() <= 1:
            found.append((np.broadcast_to((given == 1) if ones_real else (given == 0), (rows, length)), name))
    if not found:  # (else a hand-written seq2seq's source tokens at its source pad id: checks/sides.py)
        from maskcli.checks.sides import side_tokens

        said = side_tokens(top, "src", (rows, length))
        if said is not None and said[0].shape == (rows, length) and said[0].any(axis=1).all():
            return said[0], said[1]
    if not found and _seq2seq(top):
        # (handed no mask at all: its input ids, the encoder's, at the pad id its config states, in a run at one end
        # of each row: a padded batch fed without its attention_mask, transformers-bart-pretrain#11)
        said = stated(top, rows, length)
        if said is not None and said[2] and said[1].startswith("input ids") and said[0].any(axis=1).all():
            return said[0], f"encoder {said[1]} of {top.where} (no attention_mask given)"
    if not found or any(not np.array_equal(real, found[0][0]) for real, _ in found[1:]):
        return None
    return found[0][0], f"{found[0][1]} of {top.where}"


def _seq2seq(top) -> bool:
    """The model call's attention_mask and input ids are its encoder's: its config says is_encoder_decoder and it is
    no *ForCausalLM, whose attention_mask is the decoder's by its class, the encoder's handed as encoder_attention_mask
    (Nougat sets is_encoder_decoder=True on its MBartForCausalLM to get cross-attention)."""
    return bool(getattr(top.config, "is_encoder_decoder", False)) and "causal_lm" not in top.arguments


def _decoder_queries(top, rows: int, q_len: int) -> np.ndarray | None:
    """Bool (rows, q_len) real decoder queries where the model call states the decoder's padding for exactly those
    queries (decoder_attention_mask, tgt_key_padding_mask, or a decoder-only model's attention_mask); else None."""
    arguments = top.arguments
    names = [("decoder_attention_mask", True), ("tgt_key_padding_mask", False)]
    if not _seq2seq(top):
        names.append(("attention_mask", True))
    for name, ones_real in names:
        given = arguments.get(name)
        if isinstance(given, np.ndarray) and given.ndim == 2 and given.shape == (rows, q_len):
            return (given == 1) if ones_real else (given == 0)
    return None


def memory(run: Run) -> list:
    """A real decoder query of a cross-attention call that sees an encoder key the model call states is padding, or
    that its encoder's own self-attention masks as padding (checks/memturned.encoder_padding)."""
    found, done, read = [], set(), {}
    one_query = [call for call in run.unmasked if call.details.get("one_query")]  # (a decoder state's softmax over
    # the memory that masks nowhere: Luong attention handed no source mask, trace/masks.py)
    unmasked = [call for call in run.unmasked if cross(call) and not call.details.get("one_query")]  # (a
    # cross-attention softmax handed no mask anywhere: read against its encoder's mask alone)
    luong, bare = {id(call) for call in one_query}, {id(call) for call in unmasked}
    for call in [*run.cross, *one_query, *unmasked]:
        top = run.top(call)
        if top is None or call.stored is None:
            continue
        rows, _, q_len, k_len = call.shape
        said = memory_padding(top, rows, k_len) if top.arguments and id(call) not in bare else None
        encoded, tiled = None, said is None and id(call) not in luong and tile_padding(top, rows, k_len)
        if tiled:  # (the image input's zero tiles: checks/tiles.py)
            said = tiled
        elif said is None and id(call) not in luong:
            encoded = encoder_padding(run, call, read) or _with_own_keys(run, call, read)
            if encoded is None:
                continue
            said = (encoded.real, f"the mask of {encoded.where}")
        if said is None:
            continue
        real, source = said
        if encoded is None and not tiled and id(call) not in luong:  # (the stated memory mask calls real what the memory's own
            # encoder masks as padding: two statements of the program over one memory, the encoder's per row)
            own = encoder_padding(run, call, read)
            if own is not None and own.known and (real & ~own.real).any() and own.real.any(axis=1).all():
                real, encoded = real & own.real, own
        cells = keep(call)
        if cells is None or cells.shape[0] not in (1, rows):
            continue
        key = (call.mask, call.shape, real.tobytes())
        if key in done:
            continue
        done.add(key)
        cells = np.broadcast_to(cells.any(axis=1), (rows, q_len, k_len))
        asking = cells.any(axis=-1)  # (a query that attends to nothing takes no key: a padding query made so)
        decoder = _decoder_queries(top, rows, q_len)
        if decoder is not None:
            asking = asking & decoder
        if encoded is not None or tiled:  # (a query that sees every key where others of its row see fewer: a padding
            full = cells.all(axis=-1)  # query unmasked against NaN, a text token before the image given every key and
            asking = asking & ~(full & ~full.all(axis=1, keepdims=True))  # its output zeroed: torchtune's skip_mask)
        if encoded is not None and not encoded.known:
            found += _across_runs(call, cells, asking, encoded)
            continue
        if tiled:  # (the text's own padding, where the model call states it for these queries)
            text = stated(top, rows, q_len)
            if text is not None and text[2]:
                asking = asking & text[0]
        asking &= real.any(axis=1)[:, None]  # (a memory that is all padding: some kernels unmask its row)
        bad = cells & asking[:, :, None] & ~real[:, None, :]
        if bad.any():
            b, q, k = first_cell(bad)
            copy = encoded.copied[b] if encoded is not None and len(encoded.copied) > b else None
            copied = "" if copy is None else f", in the {copy.top.where} call whose output row {copy.row} this row's " \
                f"{copy.name} copies"  # (its rows read by content: checks/memrows.py)
            whose = f"encoder's own self-attention ({encoded.where}{copied})" if encoded is not None \
                else source if tiled else source.replace(" of ", " given to ", 1)
            though = "" if encoded is None or source == f"the mask of {encoded.where}" else \
                f", though the {source.replace(' of ', ' given to ', 1)} calls it real"
            unmasked = _unmasked(call, cells) if not though else ""
            found.append((call, Finding("encoder-padding-ignored", (
                f"batch row {b}: decoder query {q} sees encoder key {k}, which the {whose} "
                f"marks as padding ({int(bad.sum())} such cells){unmasked}{though}: the cross-attention mask drops the "
                f"encoder's padding{_why(call)}"), expected="no decoder query sees a padded encoder key", source=source,
                cell=(b, q, k))))
    return found


def _with_own_keys(run: Run, call, read: dict):
    """The memory's padding (memturned.Encoded) where the call's keys are an encoder's keys and fewer of the attention's
    own at one end (a learned null key prepended to the text's: classifier-free-guidance-pytorch's `null_key`), every
    query that attends seeing those at every call of its site (a dropped condition's call sees the null key alone), the
    encoder no layer of the call's own stack: its own keys read as real. Where both ends read so, the reading whose
    padding the call keeps to (if one does) is taken, so a mask right at either end is quiet; None where none reads so."""
    rows, _, _, k_len = call.shape
    site = [one for one in (*run.cross, *run.calls) if one.where == call.where and one.shape == call.shape
            and one.stored is not None]  # (its site's calls: cross-attentions are apart from run.calls)
    planes = [keep(one) for one in (call, *[one for one in site if one is not call])]
    if any(one is None or one.shape[0] not in (1, rows) for one in planes):
        return None
    every = [np.broadcast_to(one.any(axis=1), (rows, *one.shape[2:])) for one in planes]  # (the call's, then its site's)
    cells, attending = every[0], every[0].any(axis=-1)
    for said, keys, ends in own_key_ends(run, call, every, read, lambda keys, k_len: k_len < 2 * keys):
        if _stack(said.where) == _stack(call.where) is not None or _queries_own(run, call, said.real):
            continue  # (an encoder that is no layer of the call's own stack, as a decoder's self-attention over its
            # boxes beside its cross-attention is not: surya's; nor the self-attention of the call's own queries
            # just before it, ALBEF's fusion layer: its text's padding, the image patches its keys)
        readings = []
        for offset in ends:
            real = np.ones((rows, k_len), dtype=bool)
            real[:, offset:offset + keys] = said.real
            readings.append(said._replace(real=real, where=f"{said.where}, its keys the call's {offset}-{offset + keys - 1}"))
        kept = [one for one in readings if not (cells & attending[:, :, None] & ~one.real[:, None, :]).any()]
        if readings:
            return (kept or readings)[0]
    return None


def _queries_own(run: Run, call, real: np.ndarray) -> bool:
    """The attention call just before `call` is a self-attention of its queries (as many, the same rows) whose keys seen
    are `real` (an encoder's padding read over as many keys): the queries' own padding (a fusion layer's text
    self-attention, then its cross-attention over the image), said of no memory."""
    at = bisect.bisect_left(run.calls, call.index, key=lambda one: one.index)
    before = run.calls[at - 1] if at else None
    if before is None or before.shape[0] != call.shape[0] or not before.shape[2] == before.shape[3] == call.shape[2] \
            == real.shape[1]:
        return False
    cells = keep(before)
    return cells is not None and np.array_equal(np.broadcast_to(cells.any(axis=(1, 2)), real.shape), real)


def _stack(where: str) -> str | None:
    """The module path of a call's stack of layers, before its layer number (`layers` of `layers.3.encoder_attn`, the
    block context._block names less its number); None where it has no number."""
    head, _, number = _block(where).rpartition(".")
    return head if number.isdigit() else None


def _across_runs(call, cells: np.ndarray, asking: np.ndarray, encoded) -> list:
    """The encoder's segment mask keeps each row's two runs apart, real with real and padding with padding, and says
    not which is which: a decoder query that sees keys of both sees padding whichever it is."""
    head = encoded.real
    both = (cells & head[:, None, :]).any(axis=-1) & (cells & ~head[:, None, :]).any(axis=-1) & asking
    if not both.any():
        return []
    b, q = (int(x) for x in np.argwhere(both)[0])
    first = int(np.flatnonzero(~head[b])[0])
    unmasked = _unmasked(call, cells)
    return [(call, Finding("encoder-padding-ignored", (
        f"batch row {b}: decoder query {q} sees encoder keys 0-{first - 1} and {first}-{head.shape[1] - 1}, which the "
        f"encoder's own self-attention ({encoded.where}) keeps apart, each run seeing only itself (real with real, "
        f"padding with padding; {int(both.sum())} such queries){unmasked}: whichever run is the padding, this query "
        f"sees it: the cross-attention mask drops the encoder's padding{_why(call)}"),
        expected="no decoder query sees a padded encoder key", source=f"the mask of {encoded.where}", cell=(b, q, first)))]


def _unmasked(call, cells: np.ndarray) -> str:
    """Where the call masks nothing: whether it was handed no mask, or one that keeps every key (torchtune's all-True
    cross-attention mask over padded tiles)."""
    if not cells.all():
        return ""
    given = any(key in call.details for key in ("mask_dtype", "attn_mask_dtype", "key_padding_mask_dtype"))
    return " (the call's mask keeps every key)" if given or call.api not in ("sdpa", "mha") \
        else " (the call is given no mask at all)"


def _why(call) -> str:
    """What says the call is a cross-attention (checks/context.crossing), as the finding shows it."""
    reading = crossing(call)
    return f" (a cross-attention: {reading.source})" if reading.cross and reading.source else ""


RULES = (
    Rule("encoder-padding-ignored", "wrong", "steps", "a cross-attention that lets decoder queries see encoder keys the "
         "model call's encoder_attention_mask / memory_key_padding_mask marks as padding", memory),
)
