"""checks/beamcache.py: a decode step whose layers disagree on which earlier hypothesis a batch row continues (a
decoder cache left in its old beam order), the reference read here off the tokens the beam search hands its decoder."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from checkbugs import BUGS, check_bug, first, traced

BEAMCACHE = Path(__file__).parent / "data" / "beamcache"


def prefixes(path: Path, owner: str, method: str, argument: int) -> list:
    """The token prefix (rows x length, lists) handed to `owner.method` at each decode step of the program at `path`
    (its buggy run), recorded by wrapping the method and running the program's main()."""
    spec = importlib.util.spec_from_file_location(f"beam_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cls, seen = getattr(module, owner), []
    plain = getattr(cls, method)

    def recording(self, *args, **kwargs):
        seen.append(args[argument].tolist())
        return plain(self, *args, **kwargs)

    setattr(cls, method, recording)
    try:
        module.main()
    finally:
        setattr(cls, method, plain)
    return seen


def stale_cell(steps: list) -> tuple[int, tuple[int, int, int]]:
    """(decode step, first (row, 0, key)) where the cache a row holds (its own prefix of the step before) is not the
    prefix of the hypothesis it now continues, at the first step where any row's is not (the upstream meaning: the
    cache must be index_selected with the beams the top-k chose)."""
    for before, now in zip(steps, steps[1:]):
        t = len(now[0]) - 1  # (the keys the step's query sees before its own: the cached ones)
        cell = first((len(now), 1, t), lambda b, q, k: before[b][:k + 1] != now[b][:k + 1])
        if cell is not None:
            return t, cell
    raise AssertionError("no hypothesis reordered")


def test_wenet_beam_search_decoder_cache_not_reordered(tmp_path):
    """wenet-e2e/wenet#1635 (written blind, batch blind-fe): ASRModel.recognize reorders its hypotheses after the top-k
    but feeds the per-layer decoder cache back in the old order; the first decoder layer, recomputed from the reordered
    tokens, follows the new order, the second keeps the old one."""
    name = "wenet_attention_beam_search_decoder_cache_not_reordered_with_beams"
    hits = check_bug(tmp_path, name, "cache-not-reordered")
    step, cell = stale_cell(prefixes(BUGS / f"{name}.py", "TransformerDecoder", "forward_one_step", 2))
    [hit] = [h for h in hits if f"at decode step {step} " in h["message"]]
    assert hit["cell"] == list(cell), hit
    assert "decoders.1.self_attn they are still row" in hit["message"], hit
    assert "not reordered with the hypotheses" in hit["message"]


def test_espnet_batch_beam_search_states_not_selected(tmp_path):
    """Written another way: an ESPnet-style BatchBeamSearch over one utterance (the beams are the rows), a dataclass
    config, SDPA, the decoder's states never passed through select_state after `yseq[prev_hyp]`."""
    name = "espnet_batch_beam_search_states_not_selected"
    hits = check_bug(tmp_path, name, "cache-not-reordered", BEAMCACHE)
    step, cell = stale_cell(prefixes(BEAMCACHE / f"{name}.py", "Decoder", "batch_score", 0))
    [hit] = [h for h in hits if f"at decode step {step} " in h["message"]]
    assert hit["cell"] == list(cell) and "layers.1.self_attn they are still row" in hit["message"], hit


def test_kv_cache_reordered_with_the_beams_in_every_layer_is_quiet(tmp_path):
    """Correct: every layer's (k, v) cache index_selected with the beams (Hugging Face's _reorder_cache), eager
    softmax, two prompts of three beams: every layer finds each row's earlier keys at the row it continues."""
    status, found, report = traced(tmp_path, "gpt_beam_search_kv_cache_reordered_correct", False, BEAMCACHE)
    assert status == 0 and not [f for f in found if f["severity"] in ("wrong", "suspicious")], report
