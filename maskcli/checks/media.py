"""A Flamingo-style media cross-attention whose text sees an image placed after it, where the program says previous.

Interleaved vision-language models (Flamingo, OpenFlamingo, Otter) attend from each text token to the media
(images, each as n latents) through a cross-attention whose mask follows where each image's media token sits in the
text: the model states that token's id (`self.media_token_id`) and the text ids (`lang_x`, `input_ids`). Where the
attending module (or one above it) states `only_attend_previous=True`, a text token may see only images whose media
token is at or before it; the keys are the images' latents in order, T images of k_len / T latents each, T the media
tokens of each row. A query that sees a latent of an image placed after it contradicts that flag (Otter#41:
`attend_previous` forced False when placement augmentation was off, every caption attended the next example's image).

Quiet where no module states the flag, or states it False (OpenFlamingo's media placement augmentation attends the
next image on purpose), where rows hold different numbers of media tokens, or the keys do not split into them.
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import Run, first_cell, keep
from maskcli.checks.registry import Rule
from maskcli.text import Finding

IDS = ("lang_x", "input_ids")


def _holder(flags, where: str) -> tuple[str, bool] | None:
    """(path, value) of the innermost module at or above `where` that states only_attend_previous."""
    where = where or ""
    found = [(path, value) for path, value in flags if path == where or where.endswith("." + path)
             or where.startswith(path + ".") or path == ""]
    return max(found, key=lambda one: len(one[0]), default=None)


def later_media(run: Run) -> list:
    """Media cross-attention calls whose text queries see the latents of an image placed after them."""
    found, done = [], set()
    for call in run.cross:
        top = run.top(call)
        if top is None or call.stored is None:
            continue
        arguments = top.arguments
        media, flags = arguments.get("media_token_id"), arguments.get("only_attend_previous")
        ids = next((arguments[n] for n in IDS if isinstance(arguments.get(n), np.ndarray)), None)
        rows, _, q_len, k_len = call.shape
        if not isinstance(media, int) or not flags or ids is None or ids.shape != (rows, q_len):
            continue
        holder = _holder(flags, call.where)
        if holder is None or holder[1] is not True:
            continue  # (no module says previous only: attending the next image may be the augmentation)
        placed = ids == media
        count = placed.sum(axis=1)
        if count[0] == 0 or (count != count[0]).any() or k_len % int(count[0]):
            continue
        key = (call.mask, call.shape, ids.tobytes())
        if key in done:
            continue
        done.add(key)
        cells = keep(call)
        if cells is None or cells.shape[0] not in (1, rows):
            continue
        at = np.stack([np.flatnonzero(row) for row in placed])  # (B, T): each image's media token
        image = np.arange(k_len) // (k_len // int(count[0]))  # each key's image
        later = at[:, image][:, None, :] > np.arange(q_len)[None, :, None]  # (B, Lq, Lk): its image comes after
        bad = np.broadcast_to(cells.any(axis=1), (rows, q_len, k_len)) & later
        if bad.any():
            b, q, k = first_cell(bad)
            path, _ = holder
            found.append((call, Finding("sees-later-media", (
                f"batch row {b}: text token {q} sees latent {k} of image {int(image[k])}, whose media token (id "
                f"{media}) is at position {int(at[b, image[k]])}, after it ({int(bad.sum())} such cells), though "
                f"{path or 'the model'} states only_attend_previous=True: text may see only the images before it"),
                expected="each text token sees only images whose media token is at or before it",
                source=f"only_attend_previous=True of {path or 'the model'}", cell=(b, q, k))))
    return found


RULES = (
    Rule("sees-later-media", "wrong", "call", "a Flamingo-style media cross-attention whose text token sees an image "
         "placed after it, where the attending module states only_attend_previous=True", later_media),
)
