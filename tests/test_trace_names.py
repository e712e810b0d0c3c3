"""Every mask name a report prints pastes back: `maskcli show NAME'S EXPRESSION --len Lq [--offset Lk-Lq] FLAGS`
rebuilds the recorded mask cell for cell (maskcli/trace/names.py), for trace, model, inspect and pack, over masks
padded right, left and irregularly, decode steps, top-left queries, a static cache's placed queries, an inverted
nn.MultiheadAttention mask and FlexAttention documents. Also: MHA's key_padding_mask is the padding (issue 28 item 12)."""

from __future__ import annotations

import json
import re
import shlex

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from typer.testing import CliRunner

import maskcli
from maskcli.commands import app
from maskcli.trace.names import flags

runner = CliRunner()


def shown(arguments: list[str]) -> np.ndarray:
    """The cells `maskcli show ARGUMENTS --json` builds, (B, H, Lq, Lk)."""
    result = runner.invoke(app, ["show", *arguments, "--json"])
    assert result.exit_code == 0, (arguments, result.output)
    return np.asarray(json.loads(result.stdout)["mask"], dtype=bool)


def show_arguments(name: str, shape) -> list[str]:
    """The rule names.py documents: the name's expression and flags, then what the shape says that they do not."""
    q_len, k_len = shape[2:]
    expression, _, rest = name.partition(" (--")
    given = shlex.split("--" + rest.removesuffix(")")) if rest else []
    arguments = [expression, *given]
    if "--len" not in given:
        arguments += ["--len", str(q_len)]
    if "--offset" not in given and "--kv-len" not in given and k_len != q_len:
        arguments += ["--offset", str(k_len - q_len)]
    return arguments


def assert_pastes_back(name: str, keep: np.ndarray) -> None:
    built = shown(show_arguments(name, keep.shape))
    assert built.shape[2:] == keep.shape[2:] and built.shape[0] in (1, keep.shape[0]), (name, built.shape, keep.shape)
    assert np.array_equal(np.broadcast_to(built[:, :1], keep[:, :1].shape), keep[:, :1]), (name, built[:, 0].astype(int), keep[:, 0].astype(int))


def printed_names(groups) -> list[tuple[str, np.ndarray]]:
    """(name, the cells it names) for every group's name and every expression a finding names for the same call
    (same-as: the same cells; polarity: the cells read the other way round, the padding kept)."""
    from maskcli.trace.names import flipped_keep

    found = []
    for group in groups:
        keep = np.asarray(group.first.keep())
        if group.expression is not None:
            found.append((group.name, keep))
        for finding in group.findings:
            if finding.code == "same-as":
                found.append((re.search(r"is also (.*): the same cells$", finding.message).group(1), keep))
            elif finding.code == "polarity":
                name = re.search(r"read the other way round it is (.*): a mask in the wrong polarity", finding.message).group(1)
                found.append((name, flipped_keep(keep, group.first.details.get("key_padding"))))
    return found


def qkv(b, h, lq, lk, d=8):
    g = torch.Generator().manual_seed(0)
    return torch.randn(b, h, lq, d, generator=g), torch.randn(b, h, lk, d, generator=g), torch.randn(b, h, lk, d, generator=g)


def causal_at_end(q_len: int, k_len: int) -> torch.Tensor:
    return torch.ones(q_len, k_len, dtype=torch.bool).tril(diagonal=k_len - q_len)


def key_rows(rows: list[list[int]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.bool)[:, None, None, :]


def test_flags_say_what_the_shape_does_not():
    assert flags({"length": 4}, 4, 4) == ""
    assert flags({"length": 1, "offset": 5, "lengths": "6,3", "pad": "left"}, 1, 6) == " (--lengths 6,3 --pad left)"
    assert flags({"length": 2, "kv_len": 5}, 2, 5) == " (--kv-len 5)"  # top-left: --kv-len alone places it
    assert flags({"length": 3, "kv_len": 9, "offset": 4}, 3, 9) == " (--offset 4 --kv-len 9)"
    assert flags({"ids": "1,0;1,1", "pad_id": 0, "heads": 2}, 2, 2) == " (--ids \"1,0;1,1\")"


def test_every_name_trace_prints_pastes_back_into_show():
    q, k, v = qkv(2, 2, 5, 5)
    right = causal_at_end(5, 5) & key_rows([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    left = causal_at_end(5, 5) & key_rows([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]])
    irregular = causal_at_end(5, 5) & key_rows([[1, 1, 0, 1, 1], [1, 1, 1, 1, 1]])
    qd, kd, vd = qkv(2, 2, 1, 6)
    decode = causal_at_end(1, 6) & key_rows([[1] * 6, [0, 0, 1, 1, 1, 1]])
    window = causal_at_end(1, 6) & ~causal_at_end(1, 6).tril(diagonal=2) & key_rows([[1] * 6, [0, 0, 0, 0, 1, 1]])
    qt, kt, vt = qkv(1, 1, 2, 5)
    labels = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2, 2, 2, 2])
    equal = torch.arange(12) // 4
    qf = torch.randn(1, 1, 12, 8)
    with maskcli.trace() as t:
        F.scaled_dot_product_attention(q, k, v, is_causal=True)
        for mask in (right, left, irregular):
            F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        F.scaled_dot_product_attention(qd, kd, vd, attn_mask=decode)
        F.scaled_dot_product_attention(qd, kd, vd, attn_mask=window)
        F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)  # top-left
        for docs in (labels, equal):  # packed documents (as a FlexAttention document mask_mod keeps them: the same
            # name from any API, and SDPA is light to run)
            F.scaled_dot_product_attention(qf, qf, qf, attn_mask=(docs[:, None] == docs[None, :]) & causal_at_end(12, 12))
    names = printed_names(t.groups())
    assert [name for name, _ in names] == [
        "causal", "causal (--lengths 5,3)", "causal (--lengths 5,3 --pad left)", 'causal (--ids "1,1,0,1,1;1,1,1,1,1")',
        "causal (--lengths 6,4 --pad left)", # keys 0-2 are outside every window: only key 3 is known padding (row 0 sees it)
        'window(3) (--ids "1,1,1,1,1,1;1,1,1,0,1,1")', "causal (--kv-len 5)",
        "document(0,0,0,1,1,2,2,2,2,2,2,2)", "local(4)", "document(sizes=[4,4,4])"]
    for name, keep in names:
        assert_pastes_back(name, keep)
    from maskcli.render.trace import brief

    for name, keep in names:  # the text report prints them in brief: the same masks
        assert_pastes_back(brief(name), keep)
    long = np.repeat([0, 1, 2], [90, 110, 56])  # 256 labels, in brief their sizes
    assert brief(f"document({','.join(map(str, long))})") == "document(sizes=[90,110,56])"
    assert_pastes_back("document(sizes=[90,110,56])", ((long[:, None] == long[None, :]) & np.tri(256, dtype=bool))[None, None])


def test_an_inverted_mha_mask_with_key_padding_reads_its_padding_from_key_padding_mask():
    """nn.MultiheadAttention reads a bool attn_mask as True = masked (torch/nn/functional.py,
    multi_head_attention_forward: `attn_mask` and `key_padding_mask` are merged, True = not allowed), so a torch.tril
    meant as 'may attend' keeps the strict upper triangle. Its key 0 is seen by no query: that is no padding; batch row
    1's keys 4-5 are, as its key_padding_mask says."""
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(8, 2, batch_first=True)
    x = torch.randn(2, 6, 8)
    inverted = torch.tril(torch.ones(6, 6, dtype=torch.bool))
    padding = torch.tensor([[False] * 6, [False] * 4 + [True] * 2])
    with maskcli.trace() as t:
        _, weights = mha(x, x, x, attn_mask=inverted, key_padding_mask=padding, average_attn_weights=False)
    (group,) = t.groups()
    assert group.name == "triu(1, means=keep) (--lengths 6,4)"
    assert t.calls[0].details["key_padding"] == {"lengths": "6,4"}
    polarity = [f.message for f in group.findings if f.code == "polarity"]
    assert polarity == ["read the other way round it is causal (--lengths 6,4): a mask in the wrong polarity? "
                        "(MHA reads a bool mask as True = masked)"]
    # the reference: MHA's own weights, non-zero exactly where it attends (NaN rows see no key)
    attends = np.nan_to_num(weights.detach().numpy()) > 0
    assert np.array_equal(t.calls[0].keep(), attends)
    for name, keep in printed_names([group]):
        assert_pastes_back(name, keep)
    # without key_padding_mask MHA has no padding: nothing is read off the mask
    with maskcli.trace() as t:
        mha(x, x, x, attn_mask=inverted)
    assert t.groups()[0].name == "triu(1, means=keep)"


def test_assert_mask_and_expect_read_mhas_padding_from_its_argument():
    from maskcli.testing import assert_mask
    from maskcli.trace.expect import check

    mha = nn.MultiheadAttention(8, 2, batch_first=True)
    x = torch.randn(2, 6, 8)
    causal_block = torch.ones(6, 6, dtype=torch.bool).triu(1)  # MHA's polarity: True = masked
    with maskcli.trace() as t:
        mha(x, x, x, attn_mask=causal_block, key_padding_mask=torch.tensor([[False] * 6, [False] * 4 + [True] * 2]))
        mha(x, x, x, attn_mask=causal_block)
    assert_mask(t.calls[0], "causal")  # the key_padding_mask's padding, not stated
    assert_mask(t.calls[1], "causal")
    assert check(t.calls, [("*", "causal")]) == []
    with pytest.raises(AssertionError, match=r"the mask is not window\(2\) with the padding found \(lengths='6,4'\)"):
        assert_mask(t.calls[0], "window(2)")
    assert check(t.calls[:1], [("*", "window(2)")])[0].startswith(
        "--expect *=window(2): call 0 (MultiheadAttention prefill, mha) differs from window(2) with the padding of its "
        "key_padding_mask (--lengths 6,4): ")


def test_inspect_and_pack_commands_paste_back(tmp_path):
    # inspect: Hugging Face's left-padded mask of two queries behind four cached keys (a double loop)
    keep = np.zeros((2, 1, 2, 6), dtype=bool)
    for b, i, j in np.ndindex(2, 2, 6):
        keep[b, 0, i, j] = j <= 4 + i and not (b == 1 and j < 2)
    torch.save(torch.from_numpy(keep), tmp_path / "m.pt")
    result = runner.invoke(app, ["inspect", str(tmp_path / "m.pt"), "--json"])
    command = json.loads(result.stdout)["command"]
    assert command == "maskcli show causal --len 2 --offset 4 --lengths 6,4 --pad left"
    assert np.array_equal(shown(shlex.split(command)[2:]), keep)
    # pack: each path's `maskcli show` line against a double loop over the documents cu_seqlens gives
    packed = runner.invoke(app, ["pack", "--position-ids", "0,1,2,0,1,0", "--cu-seqlens", "0,3,5,6", "--use-cache", "no", "--json"])
    document = np.array([0, 0, 0, 1, 1, 2])
    reference = (document[:, None] == document[None, :]) & np.tri(6, dtype=bool)
    commands = [path["command"] for path in json.loads(packed.stdout)["paths"] if path.get("command")]
    assert commands
    for command in commands:
        assert np.array_equal(shown(shlex.split(command)[2:])[0, 0], reference), command


@pytest.mark.skipif(not __import__("importlib").util.find_spec("transformers"), reason="model needs the hf extra (transformers)")
def test_every_name_model_prints_pastes_back_into_show():
    """A static cache (its prefill's queries face every slot: --kv-len; a decode step placed at --offset) and left
    padding: each group's name rebuilds its calls' mask."""
    from maskcli.hf import families
    from maskcli.hf.report import view
    from maskcli.hf.run import prompt, run

    config = families.tiny(families.load("llama"), name="llama")
    result = run("llama", config, prompt((5, 3), None, 0, "left", 128), new_tokens=2, cache="static")
    names = printed_names(view(result).groups)
    assert [name for name, _ in names] == ["causal (--kv-len 7 --lengths 7,5 --pad left)",
                                           "causal (--offset 5 --kv-len 7 --lengths 7,5 --pad left)",
                                           "causal (--lengths 7,5 --pad left)"]
    for name, keep in names:
        assert_pastes_back(name, keep)


def test_the_annotated_transformers_key_padding_is_named_padding_not_a_positional_kind_with_the_same_cells():
    """The Annotated Transformer masks its source's padding with masked_fill(src_mask == 0, -1e9), src_mask
    (1, 1, 1, 6): one row of keys for every query. Its cells are also sink(4) (encoder), causal (--lengths 4) (the
    first decode step) and prefix(4) (--kv-len 6) (the next): the names say what the program meant, key padding."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "programs"))
    import annotated_transformer as annotated

    torch.manual_seed(0)
    model = annotated.make_model(11, 11, N=1, d_model=16, d_ff=32, h=2).eval()
    src = torch.LongTensor([[1, 2, 3, 4, 0, 0]])
    src_mask = (src != 0).unsqueeze(-2)
    with maskcli.trace() as t:
        annotated.greedy_decode(model, src, src_mask, max_len=4, start_symbol=0)
    named = {(g.first.where, g.first.shape[2]): g.name for g in t.groups()}
    assert named == {("encoder.layers.0.self_attn", 6): "padding (--lengths 4)",
                     ("decoder.layers.0.self_attn", 1): "full", ("decoder.layers.0.self_attn", 2): "causal",
                     ("decoder.layers.0.self_attn", 3): "causal", ("decoder.layers.0.src_attn", 1): "padding (--lengths 4)",
                     ("decoder.layers.0.src_attn", 2): "padding (--lengths 4)", ("decoder.layers.0.src_attn", 3): "padding (--lengths 4)"}
    for group in t.groups():  # each against the program's own src_mask (keys 0-3) or subsequent_mask, and pasted back
        keep = np.broadcast_to(group.first.keep(), group.first.shape)
        q_len, k_len = keep.shape[2:]
        source = group.first.where.endswith("src_attn") or group.first.where.startswith("encoder")
        want = np.broadcast_to(src_mask.numpy()[:, None], keep.shape) if source else np.tril(np.ones((q_len, k_len), bool))
        assert (keep == want).all(), group.name
        assert_pastes_back(group.name, keep)


def test_an_sdpa_key_padding_argument_names_padding_and_the_same_cells_from_a_file_stay_positional(tmp_path):
    """SDPA given a (1, 1, 1, 6) mask (one row of keys for every query) is key padding: `padding (--lengths 4)`; the same
    6 x 6 cells in a file, where no argument says so, are what inspect's recogniser reads first: sink(4)."""
    q, k, v = qkv(1, 2, 6, 6)
    row = key_rows([[1, 1, 1, 1, 0, 0]])  # (1, 1, 1, 6)
    with maskcli.trace() as t:
        F.scaled_dot_product_attention(q, k, v, attn_mask=row)
    (group,) = t.groups()
    assert group.name == "padding (--lengths 4)"
    assert_pastes_back(group.name, np.broadcast_to(row.numpy(), (1, 2, 6, 6)))
    torch.save(row[0, 0].expand(6, 6).clone(), tmp_path / "cells.pt")
    result = runner.invoke(app, ["inspect", str(tmp_path / "cells.pt"), "--json"])
    assert result.exit_code == 0 and json.loads(result.stdout)["command"] == 'maskcli show "sink(4)" --len 6'


def test_t5s_cross_attention_is_key_padding_over_the_encoders_keys_and_its_decoder_self_attention_causal():
    """T5's decoder attends to the encoder's 6 keys at every step (EncDecAttention, is_causal False), a right-padded
    batch of 6, 4 and 3 tokens: one query seeing keys 0-3 of 6 is also `causal (--lengths 6,4,3)` read as a decode
    step, but its query is no position among those keys: `padding (--lengths 6,4,3)`. Checked against an independent
    capture of what SDPA got (torch's function swapped for a recorder) and the encoder's attention mask."""
    pytest.importorskip("transformers")
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    config = T5Config(vocab_size=64, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_decoder_layers=1, num_heads=2,
                      decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    model = T5ForConditionalGeneration(config).eval()
    ids = torch.tensor([[5, 6, 7, 8, 9, 10], [5, 6, 7, 8, 0, 0], [5, 6, 7, 0, 0, 0]])
    seen, real = [], F.scaled_dot_product_attention

    def recording(query, key, value, attn_mask=None, **kwargs):
        seen.append((query.shape[2], key.shape[2], attn_mask))
        return real(query, key, value, attn_mask=attn_mask, **kwargs)

    with maskcli.trace() as t, torch.no_grad():
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)
            model.generate(ids, attention_mask=(ids != 0).long(), max_new_tokens=3, min_new_tokens=3, do_sample=False)
    cross = [g for g in t.groups() if "EncDecAttention" in g.first.where]
    assert [g.name for g in cross] == ["padding (--lengths 6,4,3)"]
    assert [g.name for g in t.groups() if "decoder" in g.first.where and "SelfAttention" in g.first.where] == ["full", "causal", "causal"]
    real_keys = (ids != 0).numpy()[:, None, None, :]
    calls = [c for c in t.calls if "EncDecAttention" in c.where]
    recorded = [(q_len, k_len, mask) for q_len, k_len, mask in seen if k_len == 6 and q_len == 1]
    assert len(calls) == len(recorded) == 3
    for call, (_, _, mask) in zip(calls, recorded):
        keep = np.broadcast_to(call.keep(), call.shape)
        assert (keep == np.broadcast_to(real_keys, keep.shape)).all()
        assert (keep == np.broadcast_to((mask > torch.finfo(mask.dtype).min / 2).numpy(), keep.shape)).all()
    assert_pastes_back(cross[0].name, np.broadcast_to(cross[0].first.keep(), cross[0].first.shape))
