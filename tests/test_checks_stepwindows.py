"""checks/stepwindows.py: one call site whose prompt pass and decode steps lay sliding windows of different widths."""

from __future__ import annotations

from pathlib import Path

import torch

from checkbugs import check_bug, traced

WINDOWS = Path(__file__).parent / "data" / "windows"


def _widest(mask: torch.Tensor) -> int:
    """The most keys a query row of a (Lq, Lk) keep mask sees, by a loop over its cells."""
    return max(sum(1 for k in range(mask.shape[1]) if mask[q, k]) for q in range(mask.shape[0]))


def test_eole_prefill_sliding_window_one_key_too_many(tmp_path):
    """eole-nlp/eole#340: the prefill mask `tril & triu_(-sliding_window)` gives each prompt token sliding_window + 1
    keys while the cached decode keeps `position >= step - sliding_window + 1`, sliding_window keys (both over a
    static buffer of 16 slots). The fix's token-by-token decode over the buffer, filled slot by slot from position 0,
    is no top-left mask (its queries are the written slots, trace/zerokv.py's `unwritten`)."""
    window = 4
    prefill = torch.ones(10, 16, dtype=torch.bool).tril().triu(-window)
    [hit, *_] = check_bug(tmp_path, "eole_prefill_sliding_window_one_key_too_many", "window-differs-at-decode")
    assert f"is window({_widest(prefill)})" in hit["message"] and f"sees the {window} keys up to its own" in hit["message"]


def test_a_left_padded_prompt_mask_that_counts_the_query_beside_its_window(tmp_path):
    """Written another way: a dynamic cache grown by torch.cat over a left-padded batch of two prompts; the prompt mask
    keeps `q - k <= window` (window + 1 keys), each decode step `q - k < window`. Found on both layers; the fix quiet."""
    name = "left_padded_prefill_window_counts_the_query_twice"
    status, found, report = traced(tmp_path, name, False, WINDOWS)
    assert status == 1, report
    hits = [f for f in found if f["code"] == "window-differs-at-decode" and f["severity"] == "wrong"]
    q = torch.arange(7)[:, None]
    k = torch.arange(7)[None, :]
    assert len(hits) == 2 and f"is window({_widest((k <= q) & (q - k <= 3))})" in hits[0]["message"], report
    status, found, report = traced(tmp_path, name, True, WINDOWS)
    assert status == 0 and [f for f in found if f["severity"] == "wrong"] == [], report


def test_the_window_read_off_the_runs_is_the_one_read_off_the_cells():
    """_each_sees (a decode step's window from its stored runs, no pass over the cells) says window(W) only where
    _shown, which resolves the real keys and reads every query's keys, says it too: windows of 4, 8 and 32 over
    unpadded and left-padded batches, asked W - 1, W and W + 1."""
    import torch

    import maskcli
    from maskcli.checks import stepwindows
    from maskcli.checks.context import Run
    from maskcli.trace.demo import Decoder, window_mask

    def generate(model, ids, steps: int, window: int) -> None:  # (benchmarks/trace.py's loop: prefill, then steps)
        real, caches = ids != 0, [[] for _ in model.layers]
        with torch.no_grad():
            logits = model(ids, window_mask(real, ids.shape[1], window), caches)
            for _ in range(steps):
                token = logits[:, -1].argmax(-1, keepdim=True)
                real = torch.cat([real, torch.ones_like(token, dtype=torch.bool)], dim=1)
                logits = model(token, window_mask(real, 1, window), caches)

    torch.manual_seed(0)
    model = Decoder(vocab=100, dim=32, heads=2, layers=1).eval()
    asked = said = 0
    for window in (4, 8, 32):
        for pad in (0, 5, 40):
            ids = torch.randint(1, 100, (2, 48))
            ids[1, :pad] = 0
            with maskcli.trace() as traced:
                generate(model, ids, 3, window)
            traced.settle()
            run = Run(traced.calls, traced.tops)
            for call in run.calls:
                top, own, _ = run.placed(call)
                if call.shape[2] < call.shape[3] and len(own):
                    for width in (window - 1, window, window + 1):
                        if stepwindows._each_sees(call, top, own, width):
                            asked += 1
                            said += stepwindows._shown(call, top, own) == width
    assert asked >= 9 and said == asked
