"""inspect: masks saved by maskcli and by other libraries are recognised by rebuilding; findings; hostile files run nothing.

References are independent of maskcli's builders: torch.tril/triu, PyTorch's own mask helpers,
FlexAttention's create_mask, masks written out by hand the way Hugging Face builds them, and
nn.MultiheadAttention / SDPA outputs.
"""

from __future__ import annotations

import json
import pickle
import shlex
import struct

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_mask
from typer.testing import CliRunner

from maskcli.commands import app

runner = CliRunner()
F32_MIN = torch.finfo(torch.float32).min


def ok(args):
    result = runner.invoke(app, [str(a) for a in args], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    return result


def report(path, *extra):
    return json.loads(ok(["inspect", path, "--json", *extra]).stdout)


def shown(command: str) -> dict:
    """What a `maskcli show ...` command builds, from its own --json."""
    args = shlex.split(command)
    assert args[:2] == ["maskcli", "show"], command
    return json.loads(ok([*args[1:], "--json"]).stdout)


def dense(command: str) -> torch.Tensor:
    return torch.tensor(shown(command)["mask"], dtype=torch.bool)


def lower_right(q_len: int, k_len: int) -> torch.Tensor:
    return torch.ones(q_len, k_len, dtype=torch.bool).tril(diagonal=k_len - q_len)


# --- every builtin kind, saved in every convention, read back as itself ----------------

KINDS = [
    "causal --len 6",
    "causal --len 4 --heads 3",
    "tril --len 5 --diagonal 2",
    "tril --len 6 --diagonal 1",
    "triu --len 5 --diagonal 3",
    "triu --len 6 --diagonal 0 --means keep",
    "padding --lengths 4,2",
    "padding --len 5 --lengths 3,5,1",
    "prefill --offset 3 --len 2",
    "prefill --offset 1 --len 4",
    "chunk --chunks 0,0,1,1,1,2",
    "chunk --chunks 0,0,0,1,1,2,2,2",
    "window --len 8 --window 3",
    "window --len 6 --window 1",
    "prefix --len 6 --prefix 2",
    "prefix --len 7 --prefix 4",
    "document --chunks 0,0,1,1,1,2",
    "document --chunks 0,0,1,1,1",  # (0,0,0,1,1 is local(3) as well, which inspect names first)
    "causal --lengths 5,3",
    "causal --len 6 --lengths 6,4,1",
    "prefill --offset 2 --len 3 --lengths 5,3",
    "window --len 6 --window 3 --lengths 6,4",
    "chunk --chunks 0,0,1,1,2,2 --lengths 6,5",
]


def same_kind(found: dict, original: dict) -> None:
    """The suggested command rebuilds the original: same kind, same parameters, same cells."""
    rebuilt = shown(found["command"])
    assert rebuilt["mask"] == original["mask"]
    assert (rebuilt["kind"], rebuilt["params"]) == (original["kind"], original["params"])


@pytest.mark.parametrize("convention", ["keep", "block", "additive", "min", "int"])
@pytest.mark.parametrize("args", KINDS)
def test_every_kind_saved_as_pt_is_recognised_as_itself(tmp_path, args, convention):
    original = json.loads(ok(["show", *args.split(), "--json"]).stdout)
    ok(["show", *args.split(), "--as", convention, "--save", tmp_path / "m.pt"])
    found = report(tmp_path / "m.pt")
    assert found["convention"] == convention and found["convention_sure"], found["convention_note"]
    if original["kind"] in ("tril", "triu"):
        # tril(d) read as keep is triu(d + 1) read as block: the same cells. inspect names the one whose
        # 1-cells are the cells the file marks (True/1 attend in keep and int; True/-inf/min masked otherwise).
        rebuilt = shown(found["command"])
        assert rebuilt["mask"] == original["mask"]
        assert rebuilt["params"]["means"] == ("keep" if convention in ("keep", "int") else "block")
        if rebuilt["params"]["means"] == original["params"]["means"]:
            assert (rebuilt["kind"], rebuilt["params"]) == (original["kind"], original["params"])
    else:
        same_kind(found, original)


@pytest.mark.parametrize("convention", ["keep", "additive", "int"])
@pytest.mark.parametrize("args", [a for a in KINDS if not a.startswith(("tril", "triu"))])
def test_every_kind_saved_as_npy_is_recognised_as_itself(tmp_path, args, convention):
    original = json.loads(ok(["show", *args.split(), "--json"]).stdout)
    ok(["show", *args.split(), "--as", convention, "--save", tmp_path / "m.npy"])
    found = report(tmp_path / "m.npy")
    assert found["convention"] == convention
    same_kind(found, original)


@pytest.mark.parametrize("convention", ["block", "min"])
@pytest.mark.parametrize("args", [a for a in KINDS if not a.startswith(("tril", "triu"))])
def test_every_kind_converted_to_json_is_recognised_as_itself(tmp_path, args, convention):
    original = json.loads(ok(["show", *args.split(), "--json"]).stdout)
    ok(["show", *args.split(), "--save", tmp_path / "m.pt"])
    ok(["convert", tmp_path / "m.pt", "--to", convention, "--out", tmp_path / "m.json"])
    found = report(tmp_path / "m.json")
    assert found["convention"] == convention
    same_kind(found, original)


def test_decode_step(tmp_path):
    ok(["show", "prefill", "--offset", "4", "--len", "1", "--as", "additive", "--save", tmp_path / "m.pt"])
    found = report(tmp_path / "m.pt")
    assert (found["convention"], found["command"]) == ("additive", "maskcli show causal --len 1 --offset 4")
    ok(["show", "prefill", "--offset", "4", "--len", "1", "--save", tmp_path / "m.pt"])
    found = report(tmp_path / "m.pt")  # every cell True: a bool tensor cannot say which way round it is
    assert (found["convention_how"], found["command"]) == ("cannot tell", "maskcli show causal --len 1 --offset 4")


def test_more_queries_than_keys_is_cross_attention_named_with_its_queries_apart(tmp_path):
    """A decoder of 7 tokens over 3 memory keys, the first batch row's last key padding: every query sees the memory's
    real keys (built here cell by cell), no query's position among them."""
    keep = np.ones((2, 1, 7, 3), bool)
    keep[0, :, :, 2] = False
    np.save(tmp_path / "cross.npy", keep)
    found = report(tmp_path / "cross.npy")
    assert found["command"] == "maskcli show padding --len 7 --kv-len 3 --lengths 2,3"
    assert not [f for f in found["findings"] if f["code"] == "sees-later"]
    np.save(tmp_path / "ones.npy", np.ones((1, 1, 7, 3), bool))
    assert report(tmp_path / "ones.npy")["command"] == "maskcli show full --len 7 --kv-len 3"


def test_npz_and_safetensors_with_a_key(tmp_path):
    keep = torch.ones(5, 5, dtype=torch.bool).tril()
    np.savez(tmp_path / "m.npz", input_ids=np.arange(5), attention_mask=keep.numpy())
    found = report(tmp_path / "m.npz", "--key", "attention_mask")
    assert (found["convention"], found["command"]) == ("keep", "maskcli show causal --len 5")
    raw = torch.zeros(3, 5).masked_fill(~lower_right(3, 5), float("-inf")).numpy().astype("<f4").tobytes()
    header = json.dumps({"__metadata__": {"format": "pt"}, "mask": {"dtype": "F32", "shape": [3, 5], "data_offsets": [0, len(raw)]}}).encode()
    (tmp_path / "m.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + raw)
    found = report(tmp_path / "m.safetensors", "--key", "mask")
    assert (found["convention"], found["command"]) == ("additive", "maskcli show causal --len 3 --offset 2")


def test_inline_json():
    found = json.loads(ok(["inspect", "[[1,0,0],[1,1,0],[1,1,1]]", "--json"]).stdout)
    assert (found["convention"], found["command"]) == ("int", "maskcli show causal --len 3")


# --- masks made by other libraries ------------------------------------------------------


def test_generate_square_subsequent_mask(tmp_path):
    mask = torch.nn.Transformer.generate_square_subsequent_mask(7)
    assert torch.equal(mask == 0, torch.ones(7, 7, dtype=torch.bool).tril())  # the reference: additive causal
    torch.save(mask, tmp_path / "m.pt")
    found = report(tmp_path / "m.pt")
    assert (found["convention"], found["structure"], found["command"]) == ("additive", "causal", "maskcli show causal --len 7")
    assert found["findings"] == []
    assert "nn.MultiheadAttention attn_mask: yes, as is (added to the scores)" in found["apis"]


@pytest.mark.parametrize("q_len, k_len", [(3, 7), (1, 5), (4, 4)])
def test_causal_lower_right(tmp_path, q_len, k_len):
    from torch.nn.attention.bias import causal_lower_right

    mask = causal_lower_right(q_len, k_len)._materialize()
    assert torch.equal(mask, lower_right(q_len, k_len))
    torch.save(mask, tmp_path / "m.pt")
    found = report(tmp_path / "m.pt")
    expected = "maskcli show causal --len 4" if q_len == k_len else f"maskcli show causal --len {q_len} --offset {k_len - q_len}"
    assert (found["convention"], found["command"]) == ("keep", expected)
    assert torch.equal(dense(found["command"])[0, 0], mask)


def test_causal_upper_left_is_named_as_the_other_alignment(tmp_path):
    from torch.nn.attention.bias import causal_upper_left

    mask = causal_upper_left(3, 5)._materialize()
    assert torch.equal(mask, torch.ones(3, 5, dtype=torch.bool).tril())
    torch.save(mask[None, None], tmp_path / "m.pt")
    found = report(tmp_path / "m.pt")
    # top-left is causal over a static cache: --kv-len 5 with the queries at its start
    assert (found["structure"], found["command"]) == ("causal", "maskcli show causal --len 3 --kv-len 5")
    assert torch.equal(dense(found["command"])[0, 0], mask)
    message = {f["code"]: f["message"] for f in found["findings"]}["top-left-causal"]
    assert message.startswith("causal aligned top-left") and message.endswith("bottom-right is maskcli show causal --offset 2 --len 3")
    # 2-D, the (Lq, Lk) reading wins over a [B=3, S=5] key padding reading; the finding stays
    torch.save(mask, tmp_path / "m2.pt")
    found = report(tmp_path / "m2.pt")
    assert (found["reading"], found["command"]) == ("mask", "maskcli show causal --len 3 --kv-len 5")
    assert "top-left-causal" in [f["code"] for f in found["findings"]]


def hf_keep(attention_mask: torch.Tensor, q_len: int) -> torch.Tensor:
    """A Hugging Face style 4-D keep mask [B, 1, Lq, Lk]: causal at the end of the keys, and padding from attention_mask [B, Lk]."""
    k_len = attention_mask.shape[1]
    q = torch.arange(k_len - q_len, k_len)[:, None]
    kv = torch.arange(k_len)[None, :]
    return ((kv <= q)[None] & attention_mask.bool()[:, None, :])[:, None]


def test_hugging_face_eager_mask_float32_min(tmp_path):
    keep = hf_keep(torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]), 5)
    eager = torch.zeros(2, 1, 5, 5).masked_fill(~keep, F32_MIN)
    np.save(tmp_path / "eager.npy", eager.numpy())
    found = report(tmp_path / "eager.npy")
    assert (found["convention"], found["command"]) == ("min", "maskcli show causal --lengths 5,3")
    assert found["sentinel"] == F32_MIN and "finfo(float32).min" in found["convention_note"]
    overflow = [f["message"] for f in found["findings"] if f["code"] == "sentinel-overflow"]
    assert len(overflow) == 2 and "float16" in overflow[0] and "bfloat16" in overflow[1]
    assert torch.equal(dense(found["command"]), keep)


def test_hugging_face_sdpa_mask_left_padding_with_a_kv_cache(tmp_path):
    # generation pads on the left; two new tokens after four cached ones
    keep = hf_keep(torch.tensor([[1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1]]), 2)
    torch.save(keep, tmp_path / "sdpa.pt")
    found = report(tmp_path / "sdpa.pt")
    assert found["convention"] == "keep" and found["structure"] == "causal"
    assert found["command"] == "maskcli show causal --len 2 --offset 4 --lengths 6,4 --pad left"  # (keys a suffix: left)
    assert torch.equal(dense(found["command"]), keep)


def test_hugging_face_float16_eager_mask_fits_float16(tmp_path):
    keep = hf_keep(torch.ones(1, 4, dtype=torch.long), 4)
    torch.save(torch.zeros(1, 1, 4, 4, dtype=torch.float16).masked_fill(~keep, torch.finfo(torch.float16).min), tmp_path / "m.pt")
    found = report(tmp_path / "m.pt")
    assert (found["convention"], found["command"], found["findings"]) == ("min", "maskcli show causal --len 4", [])


def test_hugging_face_2d_attention_mask_is_read_as_key_padding(tmp_path):
    torch.save(torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]), tmp_path / "attention_mask.pt")
    found = report(tmp_path / "attention_mask.pt")
    assert (found["convention"], found["reading"], found["command"]) == ("int", "key padding [B, S]", "maskcli show padding --lengths 5,3")
    assert any(line.startswith("nn.MultiheadAttention key_padding_mask: no") and "(mask == 0)" in line for line in found["apis"])


def test_expanded_padding_row_broadcasts_over_queries(tmp_path):
    valid = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]]).bool()
    torch.save(torch.zeros(2, 1, 1, 4).masked_fill(~valid[:, None, None, :], F32_MIN), tmp_path / "m.pt")
    found = report(tmp_path / "m.pt")
    assert (found["structure"], found["command"]) == ("padding", "maskcli show padding --len 4 --lengths 3,2")
    assert found["also"] == "maskcli show causal --len 1 --offset 3 --lengths 3,2"
    assert "every query" in found["structure_note"]


def test_flex_attention_create_mask(tmp_path):
    labels = torch.tensor([0, 0, 0, 1, 1, 2, 2])

    def packed(b, h, q, kv):
        return (labels[q] == labels[kv]) & (kv <= q)

    def sliding(b, h, q, kv):
        return (kv <= q) & (q - kv < 3)

    torch.save(create_mask(packed, 1, 1, 7, 7, device="cpu"), tmp_path / "doc.pt")
    assert report(tmp_path / "doc.pt")["command"] == 'maskcli show "document(0,0,0,1,1,2,2)"'
    torch.save(create_mask(sliding, 2, 4, 9, 9, device="cpu"), tmp_path / "win.pt")
    found = report(tmp_path / "win.pt")
    assert found["command"] == 'maskcli show "window(3)" --len 9 --heads 4'
    assert "2 batch rows" in found["structure_note"]


# --- polarity -------------------------------------------------------------------------


def test_masks_from_pytorch_and_hugging_face_style_code(tmp_path):
    from torch.nn.attention.bias import causal_lower_right

    torch.save(torch.nn.Transformer.generate_square_subsequent_mask(5), tmp_path / "square.pt")
    found = report(tmp_path / "square.pt")
    assert (found["convention"], found["command"]) == ("additive", "maskcli show causal --len 5")

    torch.save(causal_lower_right(3, 7)._materialize(), tmp_path / "lower_right.pt")
    found = report(tmp_path / "lower_right.pt")
    assert (found["convention"], found["command"]) == ("keep", "maskcli show causal --len 3 --offset 4")

    keep = torch.ones(5, 5, dtype=torch.bool).tril()[None, None].repeat(2, 1, 1, 1)
    keep[1, :, :, 3:] = False  # batch row 1 has 3 real tokens
    eager = torch.zeros(2, 1, 5, 5).masked_fill(~keep, torch.finfo(torch.float32).min)
    np.save(tmp_path / "eager.npy", eager.numpy())
    found = report(tmp_path / "eager.npy")
    assert (found["convention"], found["command"]) == ("min", "maskcli show causal --lengths 5,3")
    assert [f["code"] for f in found["findings"]] == ["sentinel-overflow", "sentinel-overflow"]

    torch.save(keep, tmp_path / "sdpa.pt")
    assert report(tmp_path / "sdpa.pt")["command"] == "maskcli show causal --lengths 5,3"

    def packed(b, h, q, kv):
        return (q // 3 == kv // 3) & (kv <= q)

    torch.save(create_mask(packed, 1, 1, 6, 6, device="cpu"), tmp_path / "flex.pt")
    # q // 3 == kv // 3 and causal: Llama 4's chunked attention
    assert report(tmp_path / "flex.pt")["command"] == 'maskcli show "local(3)" --len 6'


@pytest.mark.parametrize("args", ["causal --len 6", "window --len 7 --window 2", "prefix --len 6 --prefix 3",
                                  "chunk --chunks 0,0,1,1,2", "prefill --offset 2 --len 4", "causal --lengths 5,2"])
def test_flipped_bool_masks_are_recognised_as_block(tmp_path, args):
    keep = dense(f"maskcli show {args}")
    torch.save(~keep, tmp_path / "flipped.pt")
    found = report(tmp_path / "flipped.pt")
    assert (found["convention"], found["convention_sure"]) == ("block", True)
    assert torch.equal(dense(found["command"]), keep)
    torch.save(keep, tmp_path / "keep.pt")
    assert report(tmp_path / "keep.pt")["convention"] == "keep"


def test_block_mask_gives_mha_what_the_rebuilt_keep_mask_gives_sdpa(tmp_path):
    # The independent check: nn.MultiheadAttention with the file's block mask equals SDPA with the rebuilt keep mask.
    torch.save(torch.ones(6, 6, dtype=torch.bool).triu(1), tmp_path / "mha.pt")
    found = report(tmp_path / "mha.pt")
    assert (found["convention"], found["command"]) == ("block", "maskcli show causal --len 6")
    assert "nn.MultiheadAttention attn_mask: yes, as is (True = masked)" in found["apis"]
    assert "F.scaled_dot_product_attention attn_mask: no, SDPA reads True as attend; pass ~mask" in found["apis"]
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(8, 1, batch_first=True, bias=False)
    with torch.no_grad():
        mha.in_proj_weight.copy_(torch.eye(8).repeat(3, 1))  # q = k = v = x
        mha.out_proj.weight.copy_(torch.eye(8))
    x = torch.randn(1, 6, 8)
    ours, _ = mha(x, x, x, attn_mask=torch.load(tmp_path / "mha.pt", weights_only=True), need_weights=False)
    theirs = F.scaled_dot_product_attention(x, x, x, attn_mask=dense(found["command"])[0, 0])
    assert torch.allclose(ours, theirs, atol=1e-6)


def test_triu_ones_float_mask_reads_ones_as_masked(tmp_path):
    torch.save(torch.triu(torch.ones(5, 5), diagonal=1), tmp_path / "m.pt")  # masked_fill(mask.bool(), -inf) style
    found = report(tmp_path / "m.pt")
    assert (found["convention"], found["ones_mean"], found["command"]) == ("int", "masked", "maskcli show causal --len 5")
    assert "ones-masked" in [f["code"] for f in found["findings"]]


def test_polarity_it_cannot_tell_is_said(tmp_path):
    torch.save(torch.ones(4, 4, dtype=torch.bool), tmp_path / "m.pt")
    found = report(tmp_path / "m.pt")
    assert (found["convention_how"], found["convention_sure"]) == ("cannot tell", False)
    assert "every cell is True" in found["convention_note"]
    text = ok(["inspect", tmp_path / "m.pt"]).stdout
    assert "convention: keep (cannot tell)" in text


# --- findings -----------------------------------------------------------------------------


def test_fully_masked_row_and_off_by_one(tmp_path):
    keep = torch.ones(6, 6, dtype=torch.bool).tril()
    keep[2, 3] = True  # one query sees the next key
    keep[4] = False  # and one sees nothing
    torch.save(keep, tmp_path / "bug.pt")
    found = report(tmp_path / "bug.pt")
    assert found["structure"] is None
    messages = {f["code"]: f["message"] for f in found["findings"]}
    assert messages["fully-masked"].startswith("query row 4 sees no key at all")
    assert messages["sees-later"] == "query row 2 sees later keys while the others do not: an off-by-one in a causal mask? (query 2 sees key 3)"


def test_later_keys_are_not_a_finding_where_the_kind_means_them(tmp_path):
    for args in ("prefix --len 5 --prefix 3", "chunk --chunks 0,0,1,1", "padding --lengths 3,2"):
        ok(["show", *args.split(), "--save", tmp_path / "m.pt"])
        assert report(tmp_path / "m.pt")["findings"] == [], args


def test_a_tril_past_its_diagonal_is_named_as_seeing_later_keys(tmp_path):
    # tril/triu rebuild such a mask, but mean it only by accident: attend says the same of tril --diagonal 1
    torch.save(torch.ones(4, 4).tril(1).bool(), tmp_path / "m.pt")
    found = report(tmp_path / "m.pt")
    assert found["command"] == 'maskcli show "tril(1)" --len 4'
    assert [(f["code"], f["message"]) for f in found["findings"]] == [(
        "sees-later",
        "query rows 0-2 see later keys (query 0 sees key 1): tril(1) reaches past the diagonal, "
        "which a causal mask does not (an off-by-one?)",
    )]
    torch.save(torch.ones(4, 4).tril().bool(), tmp_path / "causal.pt")
    assert report(tmp_path / "causal.pt")["findings"] == []


def test_minus_1e9_overflows_float16_only(tmp_path):
    torch.save(torch.zeros(4, 4).masked_fill(~torch.ones(4, 4, dtype=torch.bool).tril(), -1e9), tmp_path / "m.pt")
    assert torch.tensor(-1e9).half().item() == float("-inf") and torch.tensor(-1e9).bfloat16().item() > float("-inf")
    found = report(tmp_path / "m.pt")
    assert found["convention"] == "min" and found["command"] == "maskcli show causal --len 4"
    assert [f["code"] for f in found["findings"]] == ["sentinel-overflow"]
    assert "does not fit float16" in found["findings"][0]["message"]


def test_3d_mask_with_the_head_count_first(tmp_path):
    torch.save(torch.ones(8, 4, 4).tril().bool(), tmp_path / "three.pt")
    found = report(tmp_path / "three.pt", "--heads", "8")
    assert "3d-heads" in [f["code"] for f in found["findings"]]
    assert "8 heads" in found["broadcast"] and "batch x heads" in found["broadcast"]
    assert found["command"] == "maskcli show causal --len 4 --heads 8"
    assert "3d-heads" not in [f["code"] for f in report(tmp_path / "three.pt", "--heads", "2")["findings"]]


def test_heads_that_differ_are_named(tmp_path):
    keep = torch.ones(1, 2, 5, 5, dtype=torch.bool).tril().clone()
    keep[0, 1] &= torch.ones(5, 5, dtype=torch.bool).triu(-1)  # head 1: window 2
    torch.save(keep, tmp_path / "m.pt")
    found = report(tmp_path / "m.pt")
    assert found["structure"] is None
    assert 'head 0: causal --len 5; head 1: "window(2)" --len 5' in found["structure_note"]


def test_an_additive_bias_is_not_a_mask(tmp_path):
    alibi = -(torch.arange(4)[:, None] - torch.arange(4)[None, :]).abs().float() * 0.5
    torch.save(alibi.masked_fill(~torch.ones(4, 4, dtype=torch.bool).tril(), float("-inf")), tmp_path / "m.pt")
    found = report(tmp_path / "m.pt")
    assert found["convention"] == "bias" and "not a mask" in found["convention_note"]
    assert found["command"] == "maskcli show causal --len 4"  # its -inf cells are causal


# --- the text report and the picture ---------------------------------------------------------


def test_text_report_then_the_mask_like_show(tmp_path):
    ok(["show", "prefill", "--offset", "2", "--len", "3", "--as", "block", "--save", tmp_path / "m.pt"])
    lines = [" ".join(line.split()) for line in ok(["inspect", tmp_path / "m.pt"]).stdout.splitlines()]
    text = " ".join(lines)
    assert lines[0] == f"{tmp_path / 'm.pt'}: bool [1, 1, 3, 5]"
    assert "convention: block — read as block (True = masked)" in text
    assert "structure: causal — rebuild it with: maskcli show causal --len 3 --offset 2" in text
    assert "findings: none" in text
    assert lines[-3:] == ["2 0 0 ║ 0 1 1", "3 0 0 ║ 0 0 1", "4 0 0 ║ 0 0 0"]  # keys 0-1 are cached


def test_text_report_with_tokens_and_findings(tmp_path):
    torch.save(torch.zeros(3, 3).masked_fill(~torch.ones(3, 3, dtype=torch.bool).tril(), torch.finfo(torch.float16).min), tmp_path / "m.pt")
    lines = [" ".join(line.split()) for line in ok(["inspect", tmp_path / "m.pt", "--tokens", "the cat sat"]).stdout.splitlines()]
    assert "convention: min — float 0 / finfo(float16).min, added to the scores (Hugging Face eager style)" in " ".join(lines)
    assert lines[-4:] == ["q \\ kv the cat sat", "0 the 0 -65504 -65504", "1 cat 0 0 -65504", "2 sat 0 0 0"]


def test_png_is_the_mask(tmp_path):
    import matplotlib.image as mpimg

    torch.save(torch.ones(4, 4, dtype=torch.bool).tril(), tmp_path / "m.pt")
    result = ok(["inspect", tmp_path / "m.pt", "--png", tmp_path / "m.png", "--json"])
    assert f"wrote {tmp_path / 'm.png'}" in result.stderr
    image = mpimg.imread(tmp_path / "m.png")
    assert image.ndim == 3 and image.shape[0] > 50 and image.shape[1] > 50


def test_help_ends_with_examples():
    result = ok(["inspect", "--help"])
    assert "Examples: maskcli show causal --len 4 --as block --save mask.pt # a mask to look at maskcli inspect mask.pt" in " ".join(result.stdout.split())


# --- hostile and broken files: one line, exit 2, nothing runs ---------------------------------


class Exploit:
    def __reduce__(self):
        import os

        return (os.system, ("touch exploited",))


def write_safetensors(path, name, dtype="F32", data=None):
    raw = np.zeros((2, 2), dtype="<f4").tobytes() if data is None else data
    header = json.dumps({name: {"dtype": dtype, "shape": [2, 2], "data_offsets": [0, len(raw)]}}).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + raw)


def hostile(tmp_path):
    (tmp_path / "empty.pt").write_bytes(b"")
    (tmp_path / "corrupt.pt").write_bytes(b"PK\x03\x04 not really a zip")
    (tmp_path / "corrupt.npy").write_bytes(b"\x93NUMPY garbage")
    (tmp_path / "corrupt.safetensors").write_bytes(b"\xff" * 12)
    (tmp_path / "corrupt.json").write_text("[[1, 0], [1")
    (tmp_path / "evil.pt").write_bytes(pickle.dumps(Exploit()))
    torch.save({"mask": Exploit()}, tmp_path / "evil_zip.pt")
    np.save(tmp_path / "evil.npy", np.array([Exploit()], dtype=object), allow_pickle=True)
    np.savez(tmp_path / "evil.npz", mask=np.array([Exploit()], dtype=object))
    torch.save(torch.zeros(2, 2, dtype=torch.complex64), tmp_path / "complex.pt")
    np.save(tmp_path / "complex.npy", np.zeros((2, 2), dtype=np.complex128))
    np.save(tmp_path / "strings.npy", np.array([["a", "b"], ["c", "d"]]))
    (tmp_path / "strings.json").write_text('[["a", "b"], ["c", "d"]]')
    torch.save(torch.zeros(1, 1, 1, 2, 2, dtype=torch.bool), tmp_path / "five.pt")
    torch.save(torch.zeros(2, 2, dtype=torch.float8_e4m3fn), tmp_path / "float8.pt")
    torch.save(torch.tensor([[0.0, float("nan")], [0.0, 0.0]]), tmp_path / "nan.pt")
    torch.save(torch.tensor([[0, 1], [2, 3]]), tmp_path / "labels.pt")
    torch.save(torch.tensor(1.0), tmp_path / "scalar.pt")
    np.savez(tmp_path / "two.npz", first=np.zeros((2, 2)), second=np.ones((2, 2)))
    write_safetensors(tmp_path / "named.safetensors", "attention_mask")
    write_safetensors(tmp_path / "c64.safetensors", "mask", "C64", np.zeros((2, 2), dtype="<c8").tobytes())
    (tmp_path / "folder.pt").mkdir()
    (tmp_path / "inf.json").write_text('[[0, "inf"], [0, 0]]')  # maskcli's own spelling of +inf in JSON
    (tmp_path / "big.json").write_text("[[0, 1e999], [0, 0]]")  # a double past float64's range: +inf to numpy


HOSTILE = [
    (["inspect", "missing.pt"], "no such file"),
    (["inspect", "empty.pt"], "the file is empty"),
    (["inspect", "corrupt.pt"], "not a readable .pt file"),
    (["inspect", "corrupt.npy"], "not a readable numpy file"),
    (["inspect", "corrupt.safetensors"], "not a readable .safetensors file"),
    (["inspect", "corrupt.json"], "not valid JSON"),
    (["inspect", "evil.pt"], "nothing in it was run"),
    (["inspect", "evil_zip.pt"], "nothing in it was run"),
    (["inspect", "evil.npy"], "would need pickle"),
    (["inspect", "evil.npz"], "would need pickle"),
    (["inspect", "complex.pt"], "complex"),
    (["inspect", "complex.npy"], "complex128"),
    (["inspect", "c64.safetensors"], "C64"),
    (["inspect", "strings.npy"], "<U1"),
    (["inspect", "strings.json"], "not a rectangular nested list of numbers"),
    (["inspect", "five.pt"], "5 dimensions"),
    (["inspect", "float8.pt"], "float8_e4m3fn"),
    (["inspect", "nan.pt"], "'nan.pt' holds NaN in 1 cells"),
    (["inspect", "labels.pt"], "'labels.pt' holds integer values {2, 3}, not a 0/1 mask"),
    (["inspect", "inf.json"], "'inf.json' holds +inf, which makes softmax NaN"),
    (["inspect", "big.json"], "'big.json' holds +inf, which makes softmax NaN"),
    (["show", "--mask", "inf.json"], "'inf.json' holds +inf, which makes softmax NaN"),
    (["inspect", "scalar.pt"], "single number"),
    (["inspect", "folder.pt"], "is a directory"),
    (["inspect", "mask.txt"], "no such file, and '.txt' is not a file type maskcli reads"),
    (["inspect", "two.npz"], "'first', 'second'"),
    (["inspect", "two.npz", "--key", "third"], "has no tensor 'third'; it holds 'first', 'second'"),
    (["inspect", "named.safetensors", "--key", "mask"], "has no tensor 'mask'; it holds 'attention_mask'"),
    (["inspect", "named.safetensors", "--png", "out.gif"], "'.gif'"),
    (["inspect", "named.safetensors", "--heads", "x"], "x"),
    (["inspect", "named.safetensors", "--tokens", "a b c"], "--tokens has 3 words but the mask has 2 key positions"),
]


@pytest.mark.parametrize("args, quoted", HOSTILE, ids=[" ".join(a) for a, _ in HOSTILE])
def test_hostile_and_broken_files(tmp_path, monkeypatch, args, quoted):
    hostile(tmp_path)
    monkeypatch.chdir(tmp_path)
    before = set(tmp_path.iterdir())
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("maskcli: error: ") and quoted in lines[0], result.stderr
    assert "Traceback" not in result.output and result.stdout == ""
    assert set(tmp_path.iterdir()) == before  # nothing ran (no 'exploited' file), nothing was written
    assert not (tmp_path / "exploited").exists()


def test_from_says_which_way_round_a_bool_mask_is(tmp_path):
    keep = torch.zeros(6, 6, dtype=torch.bool)
    keep[:, 0] = True  # every query sees key 0 only: read alone, no query sees itself, so it looks like a block mask
    torch.save(keep, tmp_path / "sink.pt")
    assert report(tmp_path / "sink.pt", "--from", "keep")["command"] == "maskcli show \"sink(1)\" --len 6"
    assert report(tmp_path / "sink.pt", "--from", "block")["convention"] == "block"
    torch.save(torch.zeros(2, 2), tmp_path / "floats.pt")
    result = runner.invoke(app, ["inspect", str(tmp_path / "floats.pt"), "--from", "sideways"])
    assert result.exit_code == 2 and "'sideways'" in result.stderr


def test_big_endian_npy_is_read(tmp_path):
    np.save(tmp_path / "m.npy", np.tril(np.ones((4, 4))).astype(">f4"))
    assert report(tmp_path / "m.npy")["command"] == "maskcli show causal --len 4"


# --- expressions, not only single kinds ---------------------------------------------------------

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from maskcli.inspect.analysis import analyse  # noqa: E402
from maskcli.mask import build  # noqa: E402


@st.composite
def recognisable(draw):
    """Masks of real models, as expressions, with their length."""
    sizes = draw(st.lists(st.integers(1, 6), min_size=1, max_size=4))
    n = sum(sizes)
    form = draw(st.sampled_from(["document&window", "blocks", "sinks", "window", "prefix", "local", "offset"]))
    if form == "document&window":
        return f"document(sizes=[{','.join(map(str, sizes))}]) & window({draw(st.integers(2, 6))})", n, {}
    if form == "blocks":
        ids = []
        for i, size in enumerate(sizes):
            ids += [i if draw(st.booleans()) else -1] * size
        return f"causal | blocks({','.join(map(str, ids))})", n, {}
    if form == "sinks":
        return f"causal & (window({draw(st.integers(1, 4))}) | sink({draw(st.integers(1, 3))}))", max(n, 8), {}
    if form == "window":
        return f"window({draw(st.integers(1, 5))})", max(n, 3), {}
    if form == "prefix":
        return f"prefix({draw(st.integers(1, n))})", n, {}
    if form == "local":
        return f"local({draw(st.integers(2, 4))})", max(n, 5), {}
    return f"window({draw(st.integers(1, 5))})", 3, {"offset": draw(st.integers(1, 6))}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(recognisable())
def test_masks_of_expressions_are_rebuilt_by_the_command_inspect_names(case):
    text, length, options = case
    built = build(text, length=length, **options)
    keep = torch.from_numpy(built.dense().copy())
    found = analyse(keep).structure
    if not keep.any() or keep.all():
        return
    assert found.expression is not None, text
    rebuilt = dense(found.command)
    assert torch.equal(rebuilt.expand_as(keep), keep), (text, found.command)


def test_compositions_are_named_as_expressions(tmp_path):
    for text in ("document(0,0,0,1,1,1,1,2,2,2) & window(2)", "causal | blocks(-1,-1,0,0,0,-1,1,1,-1)"):
        ok(["show", text, "--save", tmp_path / "m.pt"])
        found = report(tmp_path / "m.pt")
        assert found["structure"] == text and found["command"] == f'maskcli show "{text}"'
    ok(["show", "causal & (window(3) | sink(2))", "--len", "12", "--save", tmp_path / "m.pt"])
    assert report(tmp_path / "m.pt")["command"] == 'maskcli show "causal & (window(3) | sink(2))" --len 12'


def test_a_mask_nothing_rebuilds_is_said_to_be_closest_to_a_kind_and_where_it_differs(tmp_path):
    keep = torch.ones(8, 8, dtype=torch.bool).tril()
    keep[4, 1] = False  # a hole in a causal mask
    torch.save(keep, tmp_path / "bug.pt")
    found = report(tmp_path / "bug.pt")
    assert found["structure"] is None
    close = found["closest"]
    assert close == {
        "expression": "causal", "command": "maskcli show causal --len 8", "cells_apart": 1,
        "rows": ["row 4: the tensor sees 0, 2-4, causal sees 0-4: the tensor hides key 1"],
    }
    text = " ".join(ok(["inspect", tmp_path / "bug.pt"]).stdout.split())
    assert "closest: maskcli show causal --len 8, 1 cell apart" in text


def test_a_long_key_padding_row_is_read_in_linear_time(tmp_path):
    from bounded import MIB, builds_under

    np.save(tmp_path / "row.npy", np.arange(100_000) < 70_000)  # [S]: one row of keys, shared by every query
    np.save(tmp_path / "alternate.npy", np.arange(100_000) % 2 == 0)
    with builds_under(512 * MIB):  # a square of 10^10 cells built to compare one row against is 9.3 GiB
        result = runner.invoke(app, ["inspect", str(tmp_path / "row.npy")])
        alternate = runner.invoke(app, ["inspect", str(tmp_path / "alternate.npy")])
    assert result.exit_code == 0, result.output
    # (at 80 columns the command goes whole on a line of its own, under the structure)
    assert "structure: padding\n  rebuild it with: maskcli show padding --len 100000 --lengths 70000\n" in result.stdout
    assert alternate.exit_code == 0 and "--ids" in alternate.stdout, alternate.output


def test_a_file_whose_name_starts_with_a_bracket_is_a_file_not_inline_json(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    np.save("[red]k.npy", np.tril(np.ones((3, 3), dtype=bool)))
    result = runner.invoke(app, ["inspect", "[red]k.npy"])
    assert result.exit_code == 0 and result.stdout.startswith("[red]k.npy: bool [3, 3]"), result.output
    assert runner.invoke(app, ["inspect", "[[1, 0], [1, 1]]"]).stdout.startswith("[[1, 0], [1, 1]]: int64 [2, 2]")


# --- .npy, .npz, .safetensors and .json without torch ---------------------------------------------

import maskfiles  # noqa: E402


def test_npy_npz_safetensors_and_json_are_inspected_without_importing_torch(tmp_path):
    names = list(maskfiles.write(tmp_path).values())
    torch.save(torch.from_numpy(maskfiles.reference()), tmp_path / "keep.pt")
    commands = [["inspect", name, *extra] for name in names for extra in ([], ["--json"])] + [["inspect", "keep.pt"]]
    ran = maskfiles.torch_after_each(commands, tmp_path)
    assert [code for _, code, _ in ran] == [0] * len(commands)
    # the last, a .pt file, needs torch: the check can see it
    assert [loaded for *_, loaded in ran] == [False] * (len(commands) - 1) + [True]


@pytest.mark.parametrize("label", list(maskfiles.tensors()))
def test_each_file_type_reads_as_the_same_tensor_saved_as_pt(tmp_path, label):
    name, tensor = maskfiles.tensors()[label]
    maskfiles.write(tmp_path)
    torch.save(tensor, tmp_path / "same.pt")
    found, expected = report(tmp_path / name), report(tmp_path / "same.pt")
    assert found.pop("file") != expected.pop("file") and found == expected
    assert found["dtype"] == str(tensor.dtype).removeprefix("torch.") and found["structure"] == "window(3)"
    conventions = {"npy": "keep", "npz": "int", "safetensors bf16": "min", "safetensors f16": "additive", "json": "block"}
    assert found["convention"] == conventions[label] and found["convention_sure"]
    if label == "safetensors bf16":
        assert found["sentinel"] == torch.finfo(torch.bfloat16).min


def test_a_numpy_dtype_torch_lacks_is_refused_by_name(tmp_path):
    np.save(tmp_path / "long.npy", np.zeros((2, 2), dtype=np.longdouble))
    result = runner.invoke(app, ["inspect", str(tmp_path / "long.npy")])
    assert result.exit_code == 2 and result.stderr == (
        f"maskcli: error: '{tmp_path / 'long.npy'}' has dtype {np.dtype(np.longdouble).name}, which cannot be a mask here: "
        "use bool, an integer type or float16/bfloat16/float32/float64\n"
    )


@pytest.mark.parametrize("text, length, flip", [("window(3)", 8, False), ("causal & (window(2) | sink(1))", 8, True),
                                                ("document(0,0,1,1,1)", 5, True)])
def test_the_structure_that_told_the_polarity_is_the_one_inspect_names(text, length, flip):
    """polarity recognises both readings to tell which way round a bool tensor is; inspect names the tensor with
    the Structure that told it, the same as recognising the reading again would (and its command rebuilds it)."""
    from maskcli.inspect.polarity import classify, marks, to_keep
    from maskcli.inspect.structure import recognise

    cells = build(text, length=length).dense()[0, 0]
    tensor = ~cells if flip else cells
    convention = classify(tensor)
    assert convention.how == "structure" and convention.structure is not None
    again = recognise(to_keep(tensor, convention)[None, None], key_padding=True, marked=marks(convention), nearest=True)
    found = analyse(tensor).structure
    assert (found.expression, found.options, found.command) == (again.expression, again.options, again.command)
    assert found.expression == text
    assert torch.equal(dense(found.command)[0, 0], torch.from_numpy(cells))


def test_at_60_columns_each_line_wraps_under_its_own_text(tmp_path):
    """Wrapped lines went to column 0: the second API of `fits:` lost its place under the first ('      nn.MultiheadAttention
    attn_mask: no, MHA reads True as' / 'masked; pass ~mask'), and the command to rebuild the mask broke in two
    ('rebuild it with: maskcli show causal' / '--len 5'). Now each wraps under its text, and the command goes whole on
    a line of its own."""
    path = tmp_path / "tril.pt"
    torch.save(torch.tril(torch.ones(5, 5, dtype=torch.bool)), path)
    result = runner.invoke(app, ["inspect", str(path)], env={"COLUMNS": "60"})
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert all(len(line) <= 60 for line in lines)
    at = next(i for i, line in enumerate(lines) if line.startswith("fits: "))
    assert lines[at:at + 4] == [
        "fits: F.scaled_dot_product_attention attn_mask: yes, as is",
        "      (True = attend)",
        "      nn.MultiheadAttention attn_mask: no, MHA reads True as",
        "      masked; pass ~mask",
    ]
    assert lines[at + 4:at + 8] == [
        "convention: keep — read as keep (True = may attend):",
        "            maskcli's causal rebuilds it read this way; read",
        "            the other way round, it would be tril(0,",
        "            means=block) with queries that see no key",
    ]
    assert lines[at + 8:at + 11] == ["structure: causal", "  rebuild it with: maskcli show causal --len 5", "findings: none"]
    wide = runner.invoke(app, ["inspect", str(path)], env={"COLUMNS": "120"}).stdout.splitlines()
    assert "structure: causal — rebuild it with: maskcli show causal --len 5" in wide
    assert "      nn.MultiheadAttention attn_mask: no, MHA reads True as masked; pass ~mask" in wide
