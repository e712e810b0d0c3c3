"""checks/leftoff.py (and trace/textheld.py, which reads what it compares): a prompt mask handed to one call of a
text-conditioned model and left off another call of it, while the function that made the calls holds that prompt's
padded mask."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np

from checkbugs import check_bug, traced
from maskcli import tracefile
from maskcli.checks.context import Run, Top
from maskcli.checks.leftoff import prompt_mask_left_off

LEFTOFF = Path(__file__).parent / "data" / "leftoff"


def first_padded_key(real: list[list[int]], q_len: int, k_len: int, start: int) -> tuple[int, int, int]:
    """The first (row, query, key) by a loop over absolute keys, the prompt at keys start .. start + T - 1, every key
    seen: the first key a row's mask calls padding."""
    for b, row in enumerate(real):
        for q in range(q_len):
            for k in range(k_len):
                if start <= k < start + len(row) and not row[k - start]:
                    return b, q, k
    raise AssertionError("no padding")


def test_simpletuner_true_cfg_unconditional_call_without_the_negative_mask(tmp_path):
    """bghira/SimpleTuner 295decc9b (written blind, batch blind-eu): Flux's true-CFG loop hands the conditional call
    `attention_mask=prompt_mask` and the unconditional one none, while `__call__` holds `negative_mask` (2 real tokens
    of 12). Both versions keep the project's FluxAttnProcessor2_0, which casts the mask to float 0/1 before SDPA adds
    it: ones-added says so on both, true of that processor, and it is the fix's only wrong finding."""
    name = "simpletuner_flux_pipeline_true_cfg_uncond_pass_drops_negative_mask"
    status, found, report = traced(tmp_path, name, False)
    [hit] = [f for f in found if f["code"] == "prompt-mask-left-off"]
    assert status == 1 and hit["severity"] == "wrong" and "`negative_mask`" in hit["message"], report
    negative = [[1, 1] + [0] * 10] * 2
    assert tuple(hit["cell"]) == first_padded_key(negative, 28, 28, 0)
    status, found, report = traced(tmp_path, name, True)
    assert {f["code"] for f in found if f["severity"] == "wrong"} == {"ones-added"}, report


def test_dit_sampler_unconditional_cross_attention_call_without_null_mask(tmp_path):
    """Written another way: a PixArt-style DiT cross-attends its prompt (keys = the prompt's 10 tokens), a bool
    encoder_attention_mask made additive, the unconditional call first and handed no mask while `sample` holds
    `null_mask` (one real token a row); the fix hands it over: quiet."""
    [hit] = check_bug(tmp_path, "dit_cfg_uncond_cross_attention_mask_left_off", "prompt-mask-left-off", LEFTOFF)
    assert "`null_mask`" in hit["message"]
    assert tuple(hit["cell"]) == first_padded_key([[1] + [0] * 9] * 2, 12, 10, 0)


def run_of(cells: np.ndarray, held: np.ndarray, handed: list, by: str = "sample()") -> Run:
    """One call of `Model` handed no mask over `cells`, its caller holding `held`; calls before it handed `handed`."""
    tops = [Top("Model", arguments={"text_mask": ("attention_mask", rows, by)}, first=i, end=i)
            for i, rows in enumerate(handed)]
    call = SimpleNamespace(index=len(handed), where="attn", api="sdpa", step=0, shape=cells.shape, details={},
                           mask="m", stored=tracefile.from_dense(cells, cells.shape))
    tops.append(Top("Model", arguments={"text_held": ("attention_mask", held.shape, (("null_mask", "sample()", held),),
                                                     "sample()")}, first=len(handed), end=len(handed) + 1))
    return Run([call], tops)


def test_quiet_where_no_sibling_masks_where_the_mask_was_handed_or_where_the_padding_is_hidden():
    """Found: a joint call over 3 image + 4 prompt keys, every key seen, the held mask none of the siblings' masks.
    Quiet: no sibling call handed a mask of that shape, or one from another function; the held mask is the one the
    sibling was handed (a reference of the same prompt); the padded keys hidden at the prompt's place."""
    held = np.array([[1, 1, 0, 0], [1, 0, 0, 0]])
    other = np.array([[1, 1, 1, 0], [1, 1, 1, 1]])
    full = np.ones((2, 1, 7, 7), bool)
    [(_, finding)] = prompt_mask_left_off(run_of(full, held, [other]))
    assert finding.code == "prompt-mask-left-off" and tuple(finding.cell) == first_padded_key(held.tolist(), 7, 7, 0)
    assert prompt_mask_left_off(run_of(full, held, [])) == []
    assert prompt_mask_left_off(run_of(full, held, [other], by="the top of reference.py")) == []
    assert prompt_mask_left_off(run_of(full, held, [np.ones((2, 5), int)])) == []
    assert prompt_mask_left_off(run_of(full, held, [held])) == []
    hidden = full.copy()
    for b in range(2):  # the prompt after the 3 image tokens: each row's padded prompt keys hidden
        for k in range(4):
            hidden[b, :, :, 3 + k] = bool(held[b, k])
    assert prompt_mask_left_off(run_of(hidden, held, [other])) == []


def test_textheld_reads_the_mask_handed_and_the_padded_masks_the_caller_holds():
    """trace/textheld.py on a module taking `encoder_hidden_states` and `attention_mask`: the mask handed (float 0/1
    read as ints); with none handed, the caller's (B, T) 0/1 variables with padding (not an all-ones one, not one of
    another shape, not one with an empty row)."""
    import sys

    import torch

    from maskcli.trace.textheld import text_held

    class Model(torch.nn.Module):
        def forward(self, x, encoder_hidden_states=None, attention_mask=None):
            return x

    model, states = Model(), torch.zeros(2, 4, 3)
    null_mask = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0]])
    ones, other, empty = torch.ones(2, 4), torch.tensor([[1, 0], [1, 1]]), torch.tensor([[0, 0, 0, 0], [1, 0, 0, 0]])
    assert (ones, other, empty) is not None  # (held by this frame, read as the caller's variables)
    caller = sys._getframe()
    handed = text_held(model, (states,), {"encoder_hidden_states": states, "attention_mask": null_mask.float()}, caller)
    assert handed["text_mask"][0] == "attention_mask" and handed["text_mask"][1].tolist() == null_mask.tolist()
    name, shape, held, by = text_held(model, (states,), {"encoder_hidden_states": states}, caller)["text_held"]
    assert (name, shape) == ("attention_mask", (2, 4)) and [h[0] for h in held] == ["null_mask"]
    assert held[0][2].tolist() == null_mask.tolist() and by.startswith("test_textheld_reads")
    assert text_held(model, (states,), {}, caller) == {}  # (no prompt handed)
