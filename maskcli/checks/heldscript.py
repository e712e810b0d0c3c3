"""A padding mask a script's top level holds, read as the batch's padding where the token ids held beside agree with it.

A script keeps its batch at its top level (`ids, mask = left_padded(pad_id)`, then `model.generate(ids, image, mask)`)
and the function it calls may drop the mask on the way (nanoVLM 8c87101: `generate` called its decoder with
`attention_mask=None`, rebinding the name it was handed, so no frame below the script holds the mask any more). A
top-level global named as a keep mask (`mask`, `attention_mask`: trace/held.py tags it "top", as its lengths) says too
little alone (a loss mask, a masked-LM's choice); it is read as the batch's padding only where token ids a function on
the stack holds (`input_ids`, kind "ids") are of its shape and one id exactly at its zeros and nowhere else, each row
one run of real tokens at one edge of different lengths (checks/held.py `_at_one_id`): the data's own padding, stated
twice. checks/held.py's padding-unused then reads it as it reads a function's (over a few more keys: an image's
tokens put before the text, heldextra.py).
"""

from __future__ import annotations


def script_padding(call, confirmed) -> list[dict]:
    """The keep masks the script's top level holds at `call` that the token ids its frames hold confirm (`confirmed`:
    held.py's `_at_one_id`, handed in: held.py is this module's caller)."""
    ids = tuple(h["rows"] for h in call.details.get("held_padding") or () if h["kind"] == "ids")
    return [held for held in call.details.get("held_top") or () if ids and held["kind"] == "keep"
            and held["rows"].ndim == 2 and confirmed(held["rows"], ids)]
