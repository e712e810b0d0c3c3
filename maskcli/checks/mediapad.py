"""A language model's mask that keeps as many tokens per row as the model call's padding says, expanded through its
media tokens, but not the same ones: media slots hidden, padding slots kept in their place.

A vision-language model whose ids hold one placeholder per image or video (the config's `image_token_index`,
`video_token_index`, `image_token_id`, `video_token_id`) expands each into P embeddings inside its forward, so the
language model attends over N = L + max(m) * (P - 1) tokens, m the placeholders of each row (transformers' LLaVA
family before the processor expanded them: `_merge_input_ids_with_image_features`). The model call's
`attention_mask` states each row's padding over its L ids, all at one side; carried through the expansion, row b
holds real_b + m_b * (P - 1) real tokens, first (right padding) or last (left padding) among the N. A self-attention
of the same model call over N tokens whose mask keeps exactly that many keys in each row (a column no query sees is a
hidden one) but hides one of those real tokens from every query, its own included, moved the padding into the row:
huggingface/transformers#34305, VideoLlava's merge with right padding and rows of different numbers of `<video>`
tokens skipped the shorter row's first video slots and marked its trailing pad slots as video (`image_to_overwrite
&= cumsum - 1 >= nb_image_pad`), and `final_attention_mask |= image_to_overwrite` made the language model attend the
padding and never the clip. Wrong.

Quiet where the ids hold no media token of the config's or two kinds of them (images and videos expand by different
P), where N - L is no multiple of the most placeholders a row holds, where the stated mask pads no row or pads rows
on different sides, where any row keeps another number of keys than the expansion says (a model that expands by
another rule, tiles of varied count, left padding's rows opened whole by SDPA's fix-up), and on cross-attention.
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import Run, keep
from maskcli.checks.registry import Rule
from maskcli.text import Finding, spans

MEDIA = ("video_token_index", "video_token_id", "image_token_index", "image_token_id")


def _media_ids(config) -> dict:
    """{id: field name} of the media placeholder ids a config (an object or a dict) states as ints."""
    found = {}
    for name in MEDIA:
        value = config.get(name) if isinstance(config, dict) else getattr(config, name, None)
        if isinstance(value, (int, np.integer)) and not isinstance(value, bool) and int(value) >= 0:
            found.setdefault(int(value), name)
    return found


def _side(real: np.ndarray) -> str | None:
    """'right' or 'left' where every padded row of bool (B, L) `real` holds its padding as one run at that side and
    some row is padded; None otherwise."""
    padded = ~real.all(axis=1)
    if not padded.any() or not real.any(axis=1).all():
        return None
    counts = real.sum(axis=1)
    cols = np.arange(real.shape[1])[None, :]
    if (real == (cols < counts[:, None])).all():
        return "right"
    if (real == (cols >= real.shape[1] - counts[:, None])).all():
        return "left"
    return None


def _stated(top) -> tuple | None:
    """(ids (B, L), real bool (B, L), side, media id, its field) where the model call was handed ids holding one kind of
    the config's media placeholders and a 0/1 mask padding its rows at one side; None otherwise."""
    media = _media_ids(top.config) if top.config is not None else {}
    if not media:
        return None
    arrays = {name: value for name, value in top.arguments.items() if isinstance(value, np.ndarray) and value.ndim == 2}
    ids = next((value for value in arrays.values() if value.dtype.kind in "iu" and np.isin(value, list(media)).any()),
               None)
    if ids is None:
        return None
    present = [one for one in media if (ids == one).any()]
    if len(present) != 1:
        return None
    mask = next((value for name, value in arrays.items() if "mask" in name.lower() and value.shape == ids.shape
                 and value is not ids and np.isin(value, (0, 1)).all()), None)
    if mask is None:
        return None
    real = mask.astype(bool)
    side = _side(real)
    return None if side is None else (ids, real, side, present[0], media[present[0]])


def media_padding_shifted(run: Run) -> list:
    """Self-attention calls over a model call's ids expanded through their media placeholders whose mask keeps each
    row's stated number of real tokens but hides one of them from every query."""
    found, done, stated = [], {}, {}
    for call in run.calls:
        top = run.top(call)
        if top is None or call.shape[2] != call.shape[3]:
            continue
        if id(top) not in stated:
            stated[id(top)] = _stated(top)
        said = stated[id(top)]
        if said is None:
            continue
        ids, real, side, media, field = said
        n, (rows, length) = call.shape[3], ids.shape
        most = int((ids == media).sum(axis=1).max())
        if call.shape[0] != rows or n <= length or (n - length) % most:
            continue
        key = (call.mask, call.shape, id(top))
        if key not in done:
            done[key] = _finding(call, said, (n - length) // most + 1, top.where)
        if done[key] is not None:
            found.append((call, done[key]))
    return found


def _finding(call, said: tuple, patches: int, where: str) -> Finding | None:
    ids, real, side, media, field = said
    cells = keep(call)
    if cells is None or cells.shape[0] not in (1, ids.shape[0]):
        return None
    n = call.shape[3]
    seen = np.broadcast_to(cells.any(axis=(1, 2)), (ids.shape[0], n))  # (B, N): keys some query sees
    count = real.sum(axis=1) + ((ids == media) & real).sum(axis=1) * (patches - 1)
    cols = np.arange(n)[None, :]
    expected = cols < count[:, None] if side == "right" else cols >= n - count[:, None]
    if (seen.sum(axis=1) != count).any():
        return None  # (another number of keys kept: another expansion, or rows SDPA opened whole)
    lost = expected & ~seen
    if not lost.any():
        return None
    b = int(np.flatnonzero(lost.any(axis=1))[0])
    k = int(np.flatnonzero(lost[b])[0])
    kept = [int(x) for x in np.flatnonzero(seen[b] & ~expected[b])]
    hidden = spans([int(x) for x in np.flatnonzero(lost[b])])
    place = "first" if side == "right" else "last"
    return Finding("media-padding-shifted", (
        f"batch row {b}: key {k} is hidden from every query, its own included, one of keys {hidden}, though the model "
        f"call's attention_mask, carried through its {field}={media} tokens ({patches} embeddings each: "
        f"{ids.shape[1]} ids, {n} tokens), makes this row's {place} {int(count[b])} tokens of {n} real ({side} "
        f"padding); the mask keeps as many, but keys {spans(kept)} are padding slots it keeps instead: the media were "
        f"written into the padding (the merge skipped the row's first media slots?)"),
        expected=f"keys {spans([int(x) for x in np.flatnonzero(expected[b])])} of batch row {b} real",
        source=f"attention_mask and {field} of {where}", cell=(b, k, k))


RULES = (
    Rule("media-padding-shifted", "wrong", "steps", "a language model's mask that keeps each row's number of real "
         "tokens, the model call's attention_mask carried through its media placeholders, but hides some of them and "
         "keeps padding slots instead (transformers#34305: VideoLlava's right-padded merge wrote the shorter row's "
         "video into its pad slots)", media_padding_shifted),
)
