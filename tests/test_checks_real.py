"""checks/real.py: the real queries and keys of each batch row, stated by the model call or read off the mask,
against a double loop over positions."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from maskcli.checks.context import Top
from maskcli.checks.real import read_off, stated

ROOT = Path(__file__).resolve().parent.parent


def _left_padded(starts, length, unmask_padding_rows):
    """Bool (B, L, L) causal over each row's real keys, by a double loop; padding rows see every key or none."""
    cells = np.zeros((len(starts), length, length), dtype=bool)
    for b, start in enumerate(starts):
        for q in range(length):
            for k in range(length):
                cells[b, q, k] = (unmask_padding_rows and q < start) or (start <= k <= q and q >= start)
    return cells


def test_padding_is_read_off_a_left_padded_mask_whether_its_padding_rows_see_every_key_or_none():
    starts, length = [3, 0, 1], 6
    for unmask in (True, False):
        keys, queries = read_off(_left_padded(starts, length, unmask), np.arange(length))
        assert keys.tolist() == [[k >= s for k in range(length)] for s in starts]
        assert queries.tolist() == [[q >= s for q in range(length)] for s in starts]


def test_one_row_or_rows_that_agree_have_no_padding_to_read():
    cells = np.broadcast_to(np.tril(np.ones((4, 4), dtype=bool)), (2, 4, 4))
    keys, queries = read_off(cells, np.arange(4))
    assert keys.all() and queries.all()


def test_the_model_calls_statement_of_its_padding_in_each_form():
    lengths = np.array([4, 2])
    expected = [[k < n for k in range(4)] for n in lengths]
    forms = {
        "attention_mask": np.array(expected, dtype=np.int64),
        "key_padding_mask": 1 - np.array(expected, dtype=np.int64),
        "lengths": lengths,
    }
    for name, value in forms.items():
        real, source, sure = stated(Top("Model", arguments={name: value}), 2, 4)
        assert real.tolist() == expected and source == f"{name} of Model" and sure
    ids = np.array([[5, 6, 7, 8], [5, 6, 0, 0]])
    real, source, sure = stated(Top("Model", arguments={"input_ids": ids, "pad_id": 0}), 2, 4)
    assert real.tolist() == expected and sure
    # a pad id that is also the EOS may end a real sequence: said, but not outright
    assert stated(Top("Model", arguments={"input_ids": ids, "pad_id": 0, "eos_id": 0}), 2, 4)[2] is False
    # the pad id inside a row (not a run at one end) is no padding
    assert stated(Top("Model", arguments={"input_ids": np.array([[5, 0, 7, 8], [5, 6, 7, 8]]), "pad_id": 0}), 2, 4) is None
    # lengths that count an input of 4 positions place no key of a call over 5 (a summary key appended: which is it?)
    assert stated(Top("Model", arguments={"lengths": lengths, "lengths_over": 4}), 2, 4)[0].tolist() == expected
    assert stated(Top("Model", arguments={"lengths": lengths, "lengths_over": 4}), 2, 5) is None
    # two statements that differ (an encoder's and a decoder's): neither is taken
    both = {"attention_mask": forms["attention_mask"], "padding_mask": np.zeros((2, 4), dtype=np.int64)}
    assert stated(Top("Model", arguments=both), 2, 4) is None


def test_a_batch_padded_to_a_static_length_states_its_padding_by_its_pad_ids():
    """No row unpadded (an exported program's fixed input length, `padding="max_length"`): each row's run of two pads
    at least, at one end, is padding where the pad id is no EOS or BOS; a double loop says which keys are real."""
    lengths, length = [5, 8], 12
    ids = np.array([[7 + k if k < n else 0 for k in range(length)] for n in lengths])
    expected = [[k < n for k in range(length)] for n in lengths]
    real, source, sure = stated(Top("Model", arguments={"input_ids": ids, "pad_id": 0}), 2, length)
    assert real.tolist() == expected and sure and source.startswith("input ids equal to the pad id 0")
    one = np.array([[5, 17, 23, 9, 31, 1] + [0] * 10])  # (a batch of one: T5's exported encoder, optimum-executorch#230)
    assert stated(Top("Model", arguments={"input_ids": one, "pad_id": 0}), 1, 16)[0].tolist() == [[k < 6 for k in range(16)]]
    left = ids[:, ::-1].copy()
    assert stated(Top("Model", arguments={"input_ids": left, "pad_id": 0}), 2, length)[0].tolist() == \
        [row[::-1] for row in expected]
    # not where a row ends in one pad id only (a sampled token, a decoder's start token), nor where the pad id is the
    # EOS (an EOS ends a text: two may close a row), nor where a row is all pad ids
    short = np.array([[7, 8, 9, 0], [7, 8, 0, 0]])
    assert stated(Top("Model", arguments={"input_ids": short, "pad_id": 0}), 2, 4) is None
    assert stated(Top("Model", arguments={"input_ids": ids, "pad_id": 0, "eos_id": 0}), 2, length) is None
    empty = np.array([[7, 8, 0, 0], [0, 0, 0, 0]])
    assert stated(Top("Model", arguments={"input_ids": empty, "pad_id": 0}), 2, 4) is None


def test_ids_of_more_axes_beside_a_stated_pad_id_are_folded_into_a_calls_rows():
    """RETRO's `retrieved` (batch, chunks, neighbours, tokens) beside `self.pad_id`: trace/padded.nested_ids keeps it
    (never a uint8 image, never without a pad id), stated() folds its leading axes into a call's rows of as many tokens,
    each cell against a double loop over the 4-D ids; a call of other rows or tokens is not read by them."""
    import torch

    from maskcli.trace.padded import nested_ids

    ids = torch.randint(1, 9, (2, 2, 2, 5))
    ids[0, 1, 0, 3:] = 0
    ids[1, 0, 1, 1:] = 0
    assert nested_ids({"x": ids}, {}) == {}  # (no pad id stated)
    assert nested_ids({"image": ids.to(torch.uint8)}, {"pad_id": 0}) == {}
    assert nested_ids({"attention_mask": ids, "position_ids": ids}, {"pad_id": 0}) == {}  # (a mask, positions)
    name, kept = nested_ids({"seq": ids[0, 0], "retrieved": ids}, {"pad_id": 0})["nested_ids"]
    assert name == "retrieved" and np.array_equal(kept, ids.numpy())
    top = Top("RETRO", arguments={"pad_id": 0, "nested_ids": (name, kept)})
    real, source, sure = stated(top, 8, 5)
    expected = [[bool(ids[b, c, n, t] != 0) for t in range(5)] for b in range(2) for c in range(2) for n in range(2)]
    assert real.tolist() == expected and sure and "`retrieved` (2, 2, 2, 5)" in source
    assert stated(top, 4, 10) is None and stated(top, 8, 4) is None


def test_the_positions_lengths_count_are_the_first_arguments_batch_first_or_sequence_first():
    """trace/padded.lengths_over: the sequence axis of a model call's first argument beside `lengths` (B,), read only
    where such lengths are handed and an axis of the first argument is their rows."""
    import inspect

    import torch

    from maskcli.trace.padded import lengths_over

    def forward(self, x, lengths=None, seq_lens=None):
        pass

    signature = inspect.signature(forward)
    lengths = torch.tensor([5, 3, 2])
    assert lengths_over(signature, {"x": torch.zeros(3, 5, 8), "lengths": lengths}) == {"lengths_over": 5}
    assert lengths_over(signature, {"x": torch.zeros(7, 3, 8), "seq_lens": lengths}) == {"lengths_over": 7}
    assert lengths_over(signature, {"x": torch.zeros(3, 5, 8)}) == {}  # (no lengths)
    assert lengths_over(signature, {"x": torch.zeros(4, 5, 8), "lengths": lengths}) == {}  # (no axis of their rows)
    assert lengths_over(signature, {"x": 1.0, "lengths": lengths}) == {}


def test_a_vision_towers_patch_mask_states_its_real_patches():
    """patch_attention_mask / patch_attn_mask, True on the real patches (trace keeps a 3-D one flattened): 1 = real,
    as attention_mask; read only where it is as long as the call's keys."""
    patches = np.array([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]])
    for name in ("patch_attention_mask", "patch_attn_mask"):
        real, source, sure = stated(Top("Tower", arguments={name: patches}), 2, 6)
        assert real.tolist() == [[k < n for k in range(6)] for n in (6, 4)] and source == f"{name} of Tower" and sure
        assert stated(Top("Tower", arguments={name: patches}), 2, 7) is None  # (another sequence's keys: a text model's)


def test_a_mask_given_wins_over_the_pad_id_in_the_input_ids():
    """A model called with an attention_mask and ids whose last token is the pad id (a real token there: GPT-2's pad
    is its EOS): the mask says it."""
    ids = np.array([[5, 6, 7, 0], [5, 6, 0, 0]])
    mask = np.array([[1, 1, 1, 1], [1, 1, 0, 0]])
    real, source, _ = stated(Top("Model", arguments={"input_ids": ids, "pad_id": 0, "attention_mask": mask}), 2, 4)
    assert real.tolist() == (mask == 1).tolist() and source == "attention_mask of Model"


@pytest.mark.parametrize("name", ["nanogpt", "mingpt", "annotated_transformer", "translation_transformer"])
def test_correct_programs_others_wrote_get_no_alarm(tmp_path, name):
    import json

    from checkbugs import runner
    from maskcli.commands import app

    out = tmp_path / "t.json"
    result = runner.invoke(app, ["trace", "--json", str(out), str(ROOT / "tests" / "programs" / f"{name}.py")])
    found = [f for g in json.loads(out.read_text())["groups"] for f in g["findings"]]
    assert result.exit_code == 0 and [f for f in found if f["severity"] == "wrong"] == [], result.output
    assert [f["code"] for f in found if f["severity"] == "suspicious"] == [], result.output


def test_a_left_padded_hugging_face_generate_gets_no_alarm():
    pytest.importorskip("transformers")
    from checkbugs import runner
    from maskcli.commands import app

    result = runner.invoke(app, ["model", "llama"])
    assert result.exit_code == 0, result.output
    assert "--pad left" in result.output and "wrong" not in result.output


def _keras_way(starts, length, query_side=False):
    """(bool (B, L) True on each row's tokens from `starts`, bool (B, L, L) causal AND that mask along the keys, or
    along the queries), by a double loop."""
    tokens = np.array([[k >= start for k in range(length)] for start in starts])
    cells = np.zeros((len(starts), length, length), dtype=bool)
    for b in range(len(starts)):
        for q in range(length):
            for k in range(q + 1):
                cells[b, q, k] = tokens[b, q] if query_side else tokens[b, k]
    return tokens, cells


def test_a_padding_mask_kept_to_exactly_the_other_way_round_is_the_programs_convention():
    from maskcli.checks.real import kept_turned

    tokens, cells = _keras_way([0, 3, 2], 7)
    own = np.arange(7)
    torch_reading = ~tokens  # (what `stated` reads from a padding_mask: True = padding)
    assert kept_turned("padding_mask of Block", torch_reading, cells, own)
    assert kept_turned("pad_mask of Block", torch_reading, cells, own)
    # torch's own argument name has one convention; an attention_mask is 1 on the tokens everywhere
    assert not kept_turned("key_padding_mask of Block", torch_reading, cells, own)
    # a mask kept to neither reading: laid along the queries, the real queries see the pads before them
    _, along_queries = _keras_way([0, 3, 2], 7, query_side=True)
    assert not kept_turned("padding_mask of Block", torch_reading, along_queries, own)


def test_a_keras_way_pad_mask_gets_no_alarm_and_one_kept_to_neither_reading_is_found(tmp_path):
    # KerasHub's padding_mask (True on the tokens) AND-ed with a causal mask: the blind reproduction's fix, and a
    # decoder written another way (left padded, an eager softmax, `pad_mask`; then an SDPA decode step whose pad_mask is
    # True on the slots written so far: held.py's padding-only-attended, read as torch's, saw only the future real)
    from checkbugs import first, traced

    blind = ROOT / "tests" / "data" / "blind"
    if (blind / "keras_hub_gemma2_flash_branch_skips_sliding_window.py").exists():
        status, found, report = traced(tmp_path, "keras_hub_gemma2_flash_branch_skips_sliding_window", True, blind)
        assert status == 0 and [f for f in found if f["severity"] == "wrong"] == [], report
    folder = ROOT / "tests" / "data" / "real"
    status, found, report = traced(tmp_path, "keras_way_pad_mask_left_padded", False, folder)
    assert status == 0 and [f for f in found if f["severity"] == "wrong"] == [], report
    status, found, report = traced(tmp_path, "keras_way_pad_mask_left_padded", False, folder, ("--query-side",))
    # (its rows say which way round pad_mask is, one of them whole: 1 = a token, so the real queries seeing the left
    # pads before them are found; a double loop's first such cell)
    lengths, t = [7, 4, 5], 7
    hit = [f for f in found if f["code"] == "padding-ignored" and f["severity"] == "wrong"]
    assert status == 1 and hit, report
    assert tuple(hit[0]["cell"]) == first((3, t, t), lambda b, q, k: k < t - lengths[b] <= q), report


def test_a_pad_mask_is_read_the_way_round_its_ids_say():
    """A `pad_mask` / `padding_mask` (names both conventions use) is torch's, 1 = padding, unless that reading calls a
    row all padding while the ids hold one id at each of its 0s and never at a 1, or, with no ids beside it, while its
    0s are one run at the same end of each row (a padded batch read the other way): then its 1s are the tokens."""
    lengths = np.array([4, 2])
    expected = [[k < n for k in range(4)] for n in lengths]  # right-padded rows of 4 and 2 tokens
    ones_on_tokens = np.array(expected, dtype=np.int64)
    ids = np.array([[5, 6, 7, 8], [5, 6, 0, 0]])
    for name in ("pad_mask", "padding_mask"):
        real, source, _ = stated(Top("Model", arguments={name: ones_on_tokens, "input_ids": ids}), 2, 4)
        assert real.tolist() == expected and source == f"{name} of Model"
        # torch's way round (1 = padding) is still read as torch's, with the same ids
        real, _, _ = stated(Top("Model", arguments={name: 1 - ones_on_tokens, "input_ids": ids}), 2, 4)
        assert real.tolist() == expected
        # without ids, the rows say it: torch's reading would call row 0 all padding, the other a padded batch
        real, _, _ = stated(Top("Model", arguments={name: ones_on_tokens}), 2, 4)
        assert real.tolist() == expected
        # and where no row is all 1s, torch's reading stands
        real, _, _ = stated(Top("Model", arguments={name: 1 - ones_on_tokens}), 2, 4)
        assert real.tolist() == expected
        # nor where the other reading is no padded batch (its 0s inside a row)
        inside = np.array([[1, 1, 1, 1], [1, 0, 1, 0]])
        real, _, _ = stated(Top("Model", arguments={name: inside}), 2, 4)
        assert real.tolist() == (inside == 0).tolist()


def test_real_tokens_read_off_runs_are_read_offs():
    """real.read_off_runs (one run of keys a row, read off starts and ends: no pass over the cells) against read_off of
    the same cells, on random runs (empty, full, padded rows), square and behind a cache; and resolve reads a call's own
    stored runs as its cells."""
    import numpy as np

    from maskcli.checks.real import _runs, read_off, read_off_runs

    rng = np.random.default_rng(5)
    for _ in range(400):
        rows, q_len = int(rng.integers(1, 4)), int(rng.integers(1, 7))
        k_len = q_len + int(rng.integers(0, 4))
        own = np.arange(k_len - q_len, k_len)
        starts = rng.integers(0, k_len + 1, (rows, q_len))
        ends = np.maximum(starts, rng.integers(0, k_len + 1, (rows, q_len)))
        if rng.random() < 0.3:
            starts[:, int(rng.integers(0, q_len))] = 0  # (a full row now and then)
            ends[:, :] = np.where(rng.random((rows, q_len)) < 0.5, k_len, ends)
        cells = (np.arange(k_len) >= starts[..., None]) & (np.arange(k_len) < ends[..., None])
        keys, mine = read_off_runs(starts, ends, own, k_len)
        want_keys, want_mine = read_off(cells, own)
        assert np.array_equal(keys, want_keys) and np.array_equal(mine, want_mine)
        stored = {"form": "intervals", "planes": [rows, 1], "shape": [rows, 1, q_len, k_len],
                  "starts": starts[:, :, None], "ends": ends[:, :, None]}
        read = _runs(stored, rows, q_len, k_len)
        assert np.array_equal(read[0], starts) and np.array_equal(read[1], ends)


def test_a_site_run_once_per_request_within_a_model_call_counts_no_positions(tmp_path):
    """trimmed() counts a site's query positions along its calls, as one sequence's. A decode kernel called once per
    request (sgl-project/sglang#4823's flashinfer port: two requests, each decode step a call per request at the same
    site) runs several sequences through the site within one model call: the count would put request 0's query at
    request 1's position (9, where it sits at 6) and call its whole cache rolled. No count there: window-miscounted
    stays silent, and the window rules that place each request's query at the end of its own keys say the bug."""
    from checkbugs import traced

    status, found, report = traced(tmp_path, "sglang_gemma3_flashinfer_decode_sliding_layers_see_full_cache", False)
    assert status == 1 and not any(f["code"] == "window-miscounted" for f in found), report
    dropped = [f for f in found if f["code"] == "window-dropped"]
    assert dropped and tuple(dropped[0]["cell"]) == (0, 6, 0)  # request 0's first decode: position 6 sees key 0
