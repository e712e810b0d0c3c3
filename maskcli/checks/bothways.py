"""A sliding layer's window where its config states the attention both ways (config.window's bidirectional branch).

Bidirectional windows are counted three ways in the code maskcli meets: |q - k| < W (Gemma 3's bidirectional overlay),
|q - k| <= W (transformers' create_bidirectional_sliding_window_mask) and |q - k| <= W / 2 (a window W wide in all); a
band of any of those reaches is the stated window. One config says which: ModernBERT's, which states `local_attention`
(the whole window) beside `sliding_window = local_attention // 2` (transformers' ModernBertConfig). Its local layers
see |q - k| <= sliding_window (transformers' ModernBertAttention and create_bidirectional_sliding_window_mask; the
original FlexBERT passes flash-attn ``window_size=(local_attention // 2, local_attention // 2)``): band(W + 1) in
maskcli's terms, and one key fewer or more on each side is an off-by-one (vllm-project/vllm#44040: the encoder-only
flash path was handed W and reached W - 1).
"""

from __future__ import annotations

from maskcli.text import Finding


def judged(stated, placed, size: int, where: str, source: str, kind) -> tuple[list[Finding], Finding | None, bool] | None:
    """(findings, a window-missing finding or None, whether the layer holds a window) of one call's mask `placed`
    against the bidirectional window `size` its config states (`source`); `kind` is the layer's (kind, field). None
    where the config states no attention both ways: transformers' ModernBertConfig states none, yet is an encoder's,
    and is judged only where its mask is a band."""
    half = _modernbert(stated, placed, size, where, source)
    if half is not None:
        return half, None, True
    if not stated.bidirectional():
        return None
    if any(placed.holds(f"band({w})") for w in (size, size + 1, size // 2 + 1)):  # |q-k| < W, <= W, <= W/2
        return [], None, True
    if any(placed.holds(f"window({w})") for w in (size, size + 1, size - 1) if w >= 1):
        sure = stated.sure_both_ways()
        return [Finding("window-one-sided", (
            f"{where} sees a causal window of about {size} keys, but its config states the attention both ways "
            f"({stated.said(stated.bidirectional())}): the window should reach {size} keys on either side "
            f"({source})" + ("" if sure else f", unless {stated.bidirectional()} is said of another part")),
            severity=None if sure else "suspicious", expected=f"band({size})", source=source)], None, True
    if placed.holds("full") and not placed.holds(f"band({size})"):
        return [], Finding("window-missing", (
            f"{where} is a sliding layer ({kind[1]}) but its mask has no window: queries see keys {size} or "
            f"more positions away ({source})"), expected=f"band({size})", source=source), False
    return [], None, False


def _modernbert(stated, placed, size: int, where: str, source: str) -> list[Finding] | None:
    """[] where the mask reaches `size` keys each side, [a finding] one key short or over, None where the config is
    not ModernBERT's or the mask is no such band."""
    whole = stated.get("local_attention")
    if not isinstance(whole, int) or isinstance(whole, bool) or whole // 2 != size or stated.get("sliding_window") != size:
        return None
    if placed.holds(f"band({size + 1})"):
        return []
    for reach, how in ((size - 1, "short"), (size + 1, "over")):
        if reach >= 1 and placed.holds(f"band({reach + 1})"):
            sure = bool(stated.transformers)
            return [Finding("window-off-by-one", (
                f"{where} sees keys up to {reach} positions away on either side, one key {how} of the {size} its config "
                f"states ({stated.said('local_attention')}: ModernBERT's local window, each side reaching "
                f"sliding_window = local_attention // 2 = {size} keys, |q - k| <= {size}, as transformers builds it)"
                + ("" if sure else ", unless this port counts its window otherwise")),
                severity=None if sure else "suspicious", expected=f"band({size + 1})", source=source)]
    return None
