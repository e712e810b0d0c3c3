"""Text tokens of a Flamingo-style media cross-attention that see no media latent: read anyway, or lost at a decode step.

Interleaved vision-language models (Flamingo, OpenFlamingo, flamingo-mini, Otter) attend from each text token to the
media latents through a cross-attention whose mask follows where the text places its media: `media_locations` (True
at each media token) handed to the model, or its ids beside the `media_token_id` it states. A text token sees the
latents of the media at or before it (text_time = the media tokens up to it), so one before its row's first media
sees none. Two bugs of that mask, each a contradiction of what the program states:

- **media-rows-uniform**: the text tokens that see no latent get uniform weights over every latent from a softmax
  over a finite fill (-max, shifted by the row max: trace/shifted.py; or a float mask's finite fill handed to SDPA or
  MHA: kernelrows.what_api_does), and the program does not zero those rows after it, so they read the image the mask
  hides from them (flamingo-mini 196c64b, lucidrains' fix: `alphas.masked_fill(text_time == 0, 0.)`). The queries
  are text the program places media in, real where no padding is stated (padding it states is left out: a padded
  token's output is the program's to drop).
- **media-lost-at-decode**: at a cached decode step (the call's self-attention reads more keys than its queries: the
  prompt before them) whose own ids hold no media token, a text query of a row sees no latent, though the latest
  prompt of the model (the last earlier call of it that read no cache, over no more tokens than the cache holds)
  placed a media token in that row, and that prompt's mask let the text after its media see the latents: the step
  recomputed the media locations from its own token alone (OpenFlamingo 5c90779: the fix keeps the prompt's and
  attends the last cached media, `use_cached_media`).

Quiet where no media statement is found, where the rows that see nothing get 0 (SDPA, the program's fill of 0 after),
on padding queries, and on decode steps whose prompt placed no media in the row.
"""

from __future__ import annotations

import numpy as np

from maskcli.checks.context import Run, cross, keep
from maskcli.checks.kernelrows import what_api_does
from maskcli.checks.real import stated
from maskcli.checks.registry import Rule
from maskcli.text import Finding

IDS = ("lang_x", "input_ids")


def placed(top, rows: int, length: int) -> tuple[np.ndarray, str] | None:
    """(bool (rows, length) media tokens, what states them) of the model call's text; None where it states none."""
    arguments = top.arguments
    given = arguments.get("media_locations")
    if isinstance(given, np.ndarray) and given.shape == (rows, length) and np.isin(given, (0, 1)).all():
        return given == 1, f"media_locations of {top.where}"
    media = arguments.get("media_token_id")
    ids = next((arguments[n] for n in IDS if isinstance(arguments.get(n), np.ndarray)), None)
    if isinstance(media, int) and ids is not None and ids.shape == (rows, length):
        return ids == media, f"the ids of {top.where} equal to its media_token_id {media}"
    return None


def _blind(call, rows: int) -> np.ndarray | None:
    """Bool (rows, Lq) queries of `call` that see no key in any head; None where its mask is not kept. A call over
    (rows * heads) matrices (torch.bmm over a batch folded with its heads) is read back to `rows` batch rows, the fold
    whose heads agree in every row (batch-major, b * H + h, first; else head-major)."""
    cells = keep(call)
    if cells is None or cells.shape[0] not in (1, call.shape[0]):
        return None
    blind = np.broadcast_to(~cells.any(axis=(1, 3)), (call.shape[0], call.shape[2]))
    if call.shape[0] == rows:
        return blind
    heads = call.shape[0] // rows
    if call.shape[0] != rows * heads or rows < 1:
        return None
    for folded in (blind.reshape(rows, heads, -1), blind.reshape(heads, rows, -1).transpose(1, 0, 2)):
        if (folded == folded[:, :1]).all():
            return folded[:, 0]
    return None


def _rows(call) -> int:
    """The call's batch rows: the layer's (B, T) queries' B where the call folds its batch with its heads."""
    given = call.details.get("query_input")
    return int(given[0]) if given and int(given[0]) and call.shape[0] % int(given[0]) == 0 else call.shape[0]


def _real(top, rows: int, length: int) -> np.ndarray:
    """Bool (rows, length) the text tokens the model call states real (all, where it states no padding)."""
    said = stated(top, rows, length)
    return np.ones((rows, length), bool) if said is None else np.broadcast_to(said[0], (rows, length))


def uniform_rows(run: Run) -> list:
    """Media cross-attention calls whose real text queries see no latent and take uniform weights over them all."""
    found, done = [], set()
    for call in run.cross:
        top = run.top(call)
        _, _, q_len, k_len = call.shape
        if top is None or not what_api_does(call).startswith("uniform weights"):
            continue
        rows = _rows(call)
        media = placed(top, rows, q_len)
        blind = _blind(call, rows) if media is not None else None
        if blind is None or not blind.any() or blind.all() or (call.mask, id(top)) in done:
            continue  # (a mask that hides every latent from every text token is no media mask this rule reads)
        done.add((call.mask, id(top)))
        real = _real(top, rows, q_len)
        hit = blind & real
        if not hit.any():
            continue
        b, q = (int(i) for i in np.argwhere(hit)[0])
        first = np.flatnonzero(media[0][b])
        where = (f"before its row's first media token (at {int(first[0])})" if first.size and q < first[0]
                 else "with no media token before it" if not first.size else "")
        found.append((call, Finding("media-rows-uniform", (
            f"batch row {b}: text token {q} {where} sees no media latent in this cross-attention ({k_len} latents, each "
            f"masked by the program; {int(hit.sum())} such text tokens, where {media[1]} places the media), and "
            f"{what_api_does(call)}: the token reads the image its mask hides from it (zero those rows' weights after "
            f"the softmax, where text_time == 0)"),
            expected="0 output for a text token that sees no media", source=media[1], cell=(b, q, 0))))
    return found


def _past(run: Run, top, q_len: int) -> int:
    """How many cached keys the model call's self-attention reads before its `q_len` queries (0 where none)."""
    for call in run.made_by(top):
        if call.shape[2] == q_len and call.shape[3] > q_len and not cross(call):
            return call.shape[3] - q_len
    return 0


def _prompt(run: Run, top, rows: int, past: int, memo: dict):
    """The latest earlier call of `top`'s model that read no cache, over at most `past` tokens of `rows` rows, as
    (Top, its media tokens (rows, L), what states them); None where there is none or it states no media."""
    at = next((i for i, one in enumerate(run.tops) if one is top), 0)  # (by identity: a Top holds arrays)
    for earlier in reversed(run.tops[:at]):
        if earlier.where != top.where:
            continue
        ids = next((earlier.arguments[n] for n in IDS if isinstance(earlier.arguments.get(n), np.ndarray)), None)
        if ids is None or ids.ndim != 2 or ids.shape[0] != rows or ids.shape[1] > past:
            continue
        if id(earlier) not in memo:
            memo[id(earlier)] = _past(run, earlier, ids.shape[1])
        if memo[id(earlier)]:
            continue  # (a decode step of its own: not a prompt)
        media = placed(earlier, rows, ids.shape[1])
        return None if media is None else (earlier, *media)
    return None


def _seen_after(run: Run, prompt, where: str, k_len: int) -> bool:
    """Whether the prompt's call at `where` over `k_len` latents lets every text token after its row's first media see
    some latent (the mask follows the media: the program's own statement of what later text sees)."""
    top, media, _ = prompt
    after = np.cumsum(media, axis=1) > 0
    for call in run.cross:  # (run.made_by holds no cross-attention call: engine.py keeps them apart)
        if not top.first <= call.index < top.end or call.where != where or call.shape[3] != k_len \
                or call.shape[2] != media.shape[1]:
            continue
        blind = _blind(call, media.shape[0])
        return blind is not None and after.any() and not (blind & after).any()
    return False


def lost_at_decode(run: Run) -> list:
    """Decode steps of a media cross-attention whose text, after the prompt's media, sees no latent."""
    found, memo, done = [], {}, set()
    for call in run.cross:
        top = run.top(call)
        _, _, q_len, k_len = call.shape
        if top is None or (call.where, id(top)) in done:
            continue
        rows = _rows(call)
        own = placed(top, rows, q_len)
        if own is None or own[0].any():
            continue  # (a step whose own ids place media: the mask is its own to read)
        blind = _blind(call, rows)
        if blind is None or not blind.any():
            continue
        done.add((call.where, id(top)))
        past = _past(run, top, q_len)
        if ("prompt", id(top)) not in memo:  # (the layers of one step share their prompt)
            memo[("prompt", id(top))] = _prompt(run, top, rows, past, memo) if past else None
        prompt = memo[("prompt", id(top))]
        if prompt is None or not _seen_after(run, prompt, call.where, k_len):
            continue
        real = _real(top, rows, q_len)
        hit = blind & real & prompt[1].any(axis=1)[:, None]
        if not hit.any():
            continue
        b, q = (int(i) for i in np.argwhere(hit)[0])
        at = int(np.flatnonzero(prompt[1][b])[0])
        found.append((call, Finding("media-lost-at-decode", (
            f"batch row {b}: text token {past + q} of a cached decode step sees no media latent ({k_len} latents), "
            f"though the prompt before it placed a media token at {at} ({prompt[2]}) and its own mask let the text "
            f"after that media see the latents: the step's media locations were read from its own tokens alone, "
            f"which hold no media token (keep the prompt's, and attend the last cached media)"),
            expected=f"text after the media token at {at} sees the latents of the media before it",
            source=prompt[2], cell=(b, q, 0))))
    return found


RULES = (
    Rule("media-rows-uniform", "wrong", "steps", "a Flamingo-style media cross-attention whose text tokens that see no "
         "latent (before their row's first media) get uniform weights over every latent from a finite fill, not zeroed "
         "after the softmax (flamingo-mini 196c64b)", uniform_rows),
    Rule("media-lost-at-decode", "wrong", "steps", "a cached decode step of a Flamingo-style media cross-attention whose "
         "text sees no latent, the media locations read from the step's own token though the prompt placed media before "
         "it (OpenFlamingo 5c90779: use_cached_media)", lost_at_decode),
)
