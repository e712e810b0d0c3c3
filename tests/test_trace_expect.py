"""maskcli.trace.expect: --expect PATTERN=EXPR, and the padding EXPR may carry (issue 29: "--expect can now also
assert padding, so that a padding lost at decode fails it")."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, strategies as st
from typer.testing import CliRunner

from maskcli.commands import app
from maskcli.errors import MaskError
from maskcli.trace.expect import _padding_at, parse, stated_padding

BUG = Path(__file__).parent / "data" / "bugs" / "padding_mask_first_step_only.py"
runner = CliRunner()


def prompt_loop(lengths, left, width, k_len):
    """Real keys by a loop: the prompt's (left or right padded to `width`), then every key after it."""
    rows = []
    for n in lengths:
        row = []
        for k in range(k_len):
            if k >= width:
                row.append(True)
            else:
                row.append(k >= width - n if left else k < n)
        rows.append(row)
    return np.array(rows)


@given(st.lists(st.integers(0, 6), min_size=1, max_size=4), st.booleans(), st.integers(0, 4))
def test_the_stated_padding_holds_the_prompt_and_leaves_later_keys_real(lengths, left, later):
    width = max(lengths)
    text = f"causal (--lengths {','.join(map(str, lengths))}{' --pad left' if left else ''})"
    expression, stated = stated_padding(text)
    assert expression == "causal" and stated["lengths"] == ",".join(map(str, lengths))
    k_len = width + later
    if k_len == 0:
        return
    from maskcli.keypadding import valid

    fields = _padding_at(stated, len(lengths), k_len)
    assert np.array_equal(valid(fields, len(lengths), k_len), prompt_loop(lengths, left, width, k_len))


def test_ids_padding_and_no_padding():
    assert stated_padding("window(3)") == ("window(3)", {})
    assert stated_padding("window(3) & causal (--ids 0,5,6;7,8,9)") == ("window(3) & causal", {"ids": "0,5,6;7,8,9"})
    fields = _padding_at({"ids": "5,0,0;7,8,9", "pad_id": 0}, 2, 5)  # right padding, then two tokens generated
    from maskcli.keypadding import valid

    assert valid(fields, 2, 5).tolist() == [[True, False, False, True, True], [True] * 5]


@pytest.mark.parametrize("value, says", [
    ("*=causal (--lens 2,4)", "'--lens' in 'causal (--lens 2,4)': the padding takes --lengths"),
    ("*=causal (--pad left)", "give the padding as --lengths L,L"),
    ("*=causal (--lengths 2,4 --pad up)", "--pad 'up' in 'causal (--lengths 2,4 --pad up)': give --pad left or --pad right"),
    ("*=causal (--lengths)", "each with its value"),
    ("*=causal (--lengths 2,x)", "take whole numbers, like --lengths 2,4"),
    ("*=causal (--ids 0,5;7)", "give every batch row as many ids"),
])
def test_a_bad_padding_is_one_line_before_the_program_runs(value, says):
    with pytest.raises(MaskError, match=None) as raised:
        parse([value])
    assert says in str(raised.value)
    result = runner.invoke(app, ["trace", "--expect", value, str(BUG)])
    assert result.exit_code == 2 and result.stderr.count("\n") == 1 and says in result.stderr, result.output


def test_serve_takes_no_padding_in_its_expressions():
    with pytest.raises(MaskError):
        parse(["*=causal (--lengths 2,4)"], padding=False)


def trace(tmp_path, *args):
    out = tmp_path / "t.json"
    result = runner.invoke(app, ["trace", "--no-check", "--json", str(out), *map(str, args)])
    return result, json.loads(out.read_text())


def test_a_padding_lost_at_decode_fails_the_name_trace_printed_for_the_prefill(tmp_path):
    """OpenNMT-py#2532 (tests/data/bugs): the padding held at the prefill only. The prefill's name, pasted as --expect,
    fails at both decode steps; read off each call (no padding stated) it cannot: the decode masks have none."""
    result, data = trace(tmp_path, BUG, "--fixed")
    name = data["groups"][0]["name"]
    assert name == "causal (--lengths 2,4 --pad left)"
    result, _ = trace(tmp_path, "--expect", f"*={name}", BUG, "--fixed")
    assert result.exit_code == 0 and "--expect: every call matched holds (1 expectation)" in result.stderr, result.output
    result, _ = trace(tmp_path, "--expect", f"*={name}", BUG)
    assert result.exit_code == 1, result.output
    said = " ".join(result.stderr.split())
    assert ("differs from causal with the padding stated (--lengths 3,5 --pad left): batch 0 row 4: the call sees 0-4, "
            "causal sees 2-4: causal hides keys 0-1") in said
    assert "1 more call differs: 2" in said


def test_the_padding_the_run_states_is_held_at_every_step(tmp_path):
    """The same bug with the bare `*=causal` a user writes: the keys the prefill masks as padding stay padding at each
    decode step (checks' padding-lost reads them so), and the decode steps that attend them fail; the fix holds."""
    result, _ = trace(tmp_path, "--expect", "*=causal", BUG)
    said = " ".join(result.stderr.split())
    assert result.exit_code == 1 and "with the padding of step 0 (--lengths 3,5 --pad left): batch 0 row 4: the call " \
        "sees 0-4, causal sees 2-4: causal hides keys 0-1" in said, result.output
    result, _ = trace(tmp_path, "--expect", "*=causal", BUG, "--fixed")
    assert result.exit_code == 0 and "--expect: every call matched holds" in result.stderr, result.output


MHA_RIGHT_PADDED = """
import torch, torch.nn as nn
torch.manual_seed(0)
mha = nn.MultiheadAttention(8, 2, batch_first=True).eval()
x = torch.randn(2, 5, 8)
real = torch.tensor([[True] * 5, [True] * 3 + [False] * 2])
allowed = torch.ones(5, 5, dtype=torch.bool).tril() & real[:, None, :] & real[:, :, None]
if WRONG:
    allowed[0, 1, 2] = True  # a real query that sees a later key
blocked = (~allowed).repeat_interleave(2, dim=0)  # (B * heads, L, S), True = masked
with torch.no_grad():
    mha(x, x, x, attn_mask=blocked, need_weights=False)
    mha(x, x, x, attn_mask=torch.ones(5, 5, dtype=torch.bool).triu(1), key_padding_mask=~real)
"""


@pytest.mark.parametrize("wrong", [False, True])
def test_a_right_padded_batch_is_causal_on_its_real_rows_whatever_its_padding_rows_see(tmp_path, wrong):
    """nn.MultiheadAttention, right-padded, the padding in its attn_mask (its padding query rows see no key) and in
    key_padding_mask (they see the real keys before them): `*=causal` holds on both; a real query that sees a later
    key still fails it (checked against torch.tril here: row 1 of batch row 0 sees key 2)."""
    script = tmp_path / "mha.py"
    script.write_text(f"WRONG = {wrong}\n" + MHA_RIGHT_PADDED)
    result, data = trace(tmp_path, "--expect", "*=causal", script)
    assert result.exit_code == int(wrong), result.output
    if wrong:
        tril = np.tril(np.ones((5, 5), bool))
        assert not tril[1, 2] and "batch 0 row 1: the call sees 0-2, causal sees 0-1" in " ".join(result.stderr.split())


def test_queries_at_the_start_of_a_static_cache_are_placed_there(tmp_path):
    """transformers#30400 (tests/data/bugs): the prefill over 8 static slots is causal with its queries at the start
    (`causal (--kv-len 8)`, placed by the cache the model call holds) and holds `*=causal`; the decode steps that
    attend the unwritten slots fail it."""
    pytest.importorskip("transformers")  # (the program builds transformers' StaticCache)
    bug = BUG.parent / "hf_static_cache_sdpa_no_mask.py"
    result, data = trace(tmp_path, bug)
    assert data["groups"][0]["name"] == "causal (--kv-len 8)"
    result, _ = trace(tmp_path, "--expect", "*=causal", bug)
    said = " ".join(result.stderr.split())
    assert result.exit_code == 1 and "call 1 (self_attn decode 1, sdpa) differs from causal: row 3: the call sees 0-7, " \
        "causal sees 0-3" in said and "1 more call differs: 2" in said, result.output
    result, _ = trace(tmp_path, "--expect", "*=causal", BUG.parent / "static_cache_no_decode_mask.py", "--fixed")
    assert result.exit_code == 0, result.output


def test_an_encoder_decoder_holds_causal_on_its_decoder_and_full_on_its_memory(tmp_path):
    """BART from its config, a padded 4-token source and a 9-token target: the model call's attention_mask is the
    source's, so it is no padding of the decoder's own keys; the cross-attention's 9 queries over 4 keys are compared
    apart from them (the memory's padding read off the call); a causal decoder expected full still fails."""
    pytest.importorskip("transformers")
    script = tmp_path / "bart.py"
    script.write_text(
        "import torch\n"
        "from transformers import BartConfig, BartForConditionalGeneration\n"
        "torch.manual_seed(0)\n"
        "model = BartForConditionalGeneration(BartConfig(vocab_size=64, d_model=16, encoder_layers=1, decoder_layers=1,\n"
        "    encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32)).eval()\n"
        "with torch.no_grad():\n"
        "    model(input_ids=torch.tensor([[5, 6, 7, 2], [5, 6, 2, 1]]), attention_mask=torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]]),\n"
        "          decoder_input_ids=torch.tensor([[2, 8, 9, 10, 11, 12, 13, 14, 15]] * 2))\n")
    held = ["--expect", "*decoder.layers.*.self_attn=causal", "--expect", "*encoder_attn=full", "--expect", "*encoder.layers.*=full"]
    result, _ = trace(tmp_path, *held, script)
    assert result.exit_code == 0 and "every call matched holds (3 expectations)" in result.stderr, result.output
    result, _ = trace(tmp_path, "--expect", "*decoder.layers.*.self_attn=full", script)
    assert result.exit_code == 1 and "row 0: the call sees 0, full sees 0-8" in " ".join(result.stderr.split()), result.output


def test_a_pattern_over_a_run_with_no_call_says_none_was_recorded():
    """A rank (or a program) that never called attention: the line says so, not 'calls came from no calls at all'."""
    from maskcli.trace.expect import check

    assert check([], [("sdpa", "causal")]) == [
        "--expect sdpa=causal: no call matches 'sdpa' (no attention call was recorded)"]
