"""An image token that sees a later image's tokens, where the model call marks its image tokens and its masks make each
image bidirectional.

Vision-language models that attend their images both ways (Gemma 3 and the engines that serve it) or the causal mask
with each image's tokens as one block: an image does not see the next image (transformers' gemma3
get_block_sequence_ids_for_mask numbers each run of image tokens). A serving engine states where the image tokens are
by a bool over the packed tokens of its requests (TensorRT-LLM's `image_token_mask`, an `image_mask`), and runs one
attention call per request (FlashInfer's custom mask, unflattened per request): the calls of one layer, in order, hold
the packed tokens one request after another. Where an image token sees a later token of its own image (the program's
masks make images bidirectional) and a query of one image sees a later key of another image of its request, the images
were made one span (TensorRT-LLM#5976: every image token typed 1, the token types compared, not each image's id).

*Wrong* where the model's config names Gemma 3 (its model_type, gemma3 or gemma3_text: each image a span of its own);
*suspicious* elsewhere, naming the condition (Molmo2 and PaliGemma's prefix make all the images one span on purpose).
Quiet where no image token sees a later token of its own image (images left causal: the spans rule's and others'),
where the calls do not partition the marked tokens, and on text tokens (the causal rules' part).
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import Run, band, first_cell, keep
from maskcli.checks.items import placed
from maskcli.checks.registry import Rule
from maskcli.checks.spans import runs
from maskcli.text import Finding

MARKS = ("image_token_mask", "image_mask")  # the model call's bool over its tokens, True = an image token
PER_IMAGE = ("gemma3", "gemma3_text")  # model_types whose images are a span each


def _marked(top) -> tuple[str, np.ndarray] | None:
    """(name, bool (L,)) of a packed mark of image tokens (1-D, or one row), where some token is an image's."""
    for name in MARKS:
        given = top.arguments.get(name)
        if isinstance(given, np.ndarray) and (given.ndim == 1 or given.ndim == 2 and given.shape[0] == 1) \
                and np.isin(given, (0, 1)).all() and given.any():
            return name, given.reshape(-1) != 0
    return None


def later_image(run: Run) -> list:
    """Per model call marking its image tokens: the first call whose image query sees a later image's key, where the
    program's masks see images both ways."""
    found = []
    for top in run.tops:
        marked = _marked(top)
        if marked is None:
            continue
        name, is_image = marked
        both_ways, leak = False, None
        for call, offset in placed(run, top, len(is_image)):
            cells = keep(call)
            if cells is None:
                continue
            n = call.shape[2]
            ids = runs(is_image[None, offset:offset + n])[0]  # (a request's own runs: an image never spans two)
            seen = cells.any(axis=(0, 1))
            later = band(n, n, 1, True)
            image_q = (ids[:, None] >= 0) & (ids[None, :] >= 0)
            both_ways = both_ways or bool((seen & later & image_q & (ids[:, None] == ids[None, :])).any())
            other = seen & later & image_q & (ids[:, None] != ids[None, :])
            if leak is None and other.any():
                q, k = first_cell(other)
                leak = (call, offset, q, k, int(ids[q]), int(ids[k]), int(other.sum()))
        if leak is None or not both_ways:
            continue
        call, offset, q, k, a, b, count = leak
        model_type = getattr(top.config, "model_type", None)
        sure = model_type in PER_IMAGE
        source = f"the model call's {name}" + (f" and its config's model_type={model_type!r}" if sure else "")
        found.append((call, Finding("image-sees-later-image", (
            f"query {q} (image {a} of the request at token {offset}) sees later key {k} of image {b} ({count} cells): "
            f"{name} marks them two images, and the masks make each image bidirectional"
            + (f", one span per image as {model_type} does" if sure else
               ", unless the model attends all its images as one span (Molmo2, PaliGemma's prefix)")),
            severity=None if sure else "suspicious", expected="causal | each image's own block", source=source,
            cell=(0, q, k))))
    return found


RULES = (
    Rule("image-sees-later-image", "wrong", "steps", "an image token that sees a later image's tokens where the model "
         "call marks its image tokens (image_token_mask) and its masks make each image bidirectional", later_image),
)
