"""`maskcli attend` through Typer's CliRunner: the tutorial's numbers, given inputs against SDPA, JSON,
bad input as one line on stderr, and the figure read back pixel by pixel."""

from __future__ import annotations

import json
import math
import struct

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from typer.testing import CliRunner

from maskcli.commands import app

runner = CliRunner()

TUTORIAL_X = [
    [0.43, 0.15, 0.89],
    [0.55, 0.87, 0.66],
    [0.57, 0.85, 0.64],
    [0.22, 0.58, 0.33],
    [0.77, 0.25, 0.10],
    [0.05, 0.80, 0.55],
]
# The causal attention weights the tutorial prints for these inputs, torch.manual_seed(789), d_out 2.
TUTORIAL_WEIGHTS = [
    [1.0000, 0.0000, 0.0000, 0.0000, 0.0000, 0.0000],
    [0.5517, 0.4483, 0.0000, 0.0000, 0.0000, 0.0000],
    [0.3800, 0.3097, 0.3103, 0.0000, 0.0000, 0.0000],
    [0.2758, 0.2460, 0.2462, 0.2319, 0.0000, 0.0000],
    [0.2175, 0.1983, 0.1984, 0.1888, 0.1971, 0.0000],
    [0.1935, 0.1663, 0.1666, 0.1542, 0.1666, 0.1529],
]
# The same weights before the mask (the tutorial's sa_v2 attn_weights), and after torch.manual_seed(123)
# and nn.Dropout(0.5), as LLMs-from-scratch prints them.
TUTORIAL_UNMASKED = [
    [0.1921, 0.1646, 0.1652, 0.1550, 0.1721, 0.1510],
    [0.2041, 0.1659, 0.1662, 0.1496, 0.1665, 0.1477],
    [0.2036, 0.1659, 0.1662, 0.1498, 0.1664, 0.1480],
    [0.1869, 0.1667, 0.1668, 0.1571, 0.1661, 0.1564],
    [0.1830, 0.1669, 0.1670, 0.1588, 0.1658, 0.1585],
    [0.1935, 0.1663, 0.1666, 0.1542, 0.1666, 0.1529],
]
TUTORIAL_DROPOUT = [
    [2.0000, 0.0000, 0.0000, 0.0000, 0.0000, 0.0000],
    [0.0000, 0.0000, 0.0000, 0.0000, 0.0000, 0.0000],
    [0.7599, 0.6194, 0.6206, 0.0000, 0.0000, 0.0000],
    [0.0000, 0.4921, 0.4925, 0.0000, 0.0000, 0.0000],
    [0.0000, 0.3966, 0.0000, 0.3775, 0.0000, 0.0000],
    [0.0000, 0.3327, 0.3331, 0.3084, 0.3331, 0.0000],
]
STAGE_NAMES = ["scores", "scaled", "masked", "weights", "output"]


def invoke(args, **kwargs):
    return runner.invoke(app, ["attend", *map(str, args)], **kwargs)


def attend_json(args):
    result = invoke([*args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def tensor(nested):
    """JSON nested lists (with "nan", "inf", "-inf" strings) back to a float64 tensor."""
    spelled = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}

    def convert(item):
        return [convert(x) for x in item] if isinstance(item, list) else spelled.get(item, item)

    return torch.tensor(convert(nested), dtype=torch.float64)


def rounded(rows, places=4):
    return [[round(value, places) + 0.0 for value in row] for row in rows]


# --- the tutorial ---------------------------------------------------------------------------


def test_tutorial_inputs_and_seed_give_the_tutorial_weights():
    data = attend_json(["causal", "--x", json.dumps(TUTORIAL_X), "--seed", 789, "--d-out", 2])
    assert data["shape"] == [1, 1, 6, 6]
    assert rounded(data["stages"]["weights"][0][0]) == TUTORIAL_WEIGHTS
    assert data["findings"] == []


def test_tutorial_tables_digit_for_digit_with_dropout_like_the_book():
    tutorial = ["causal", "--like", "tutorial", "--x", json.dumps(TUTORIAL_X), "--seed", 789, "--d-out", 2]
    data = attend_json(tutorial)
    assert rounded(data["stages"]["unmasked"][0][0]) == TUTORIAL_UNMASKED
    assert rounded(data["stages"]["weights"][0][0]) == TUTORIAL_WEIGHTS
    dropped = attend_json([*tutorial, "--dropout", 0.5, "--dropout-seed", 123])
    assert rounded(dropped["stages"]["weights"][0][0]) == TUTORIAL_DROPOUT
    table = invoke([*tutorial, "--dropout", 0.5, "--dropout-seed", 123, "--stages", "weights"])
    assert "weights = softmax(masked), then nn.Dropout(0.5)" in table.stdout
    assert " 4        0.0000   0.3966   0.0000   0.3775   0.0000  0.0000×\n" in table.stdout


def test_like_and_fill_together_and_mha_dropout_are_refused():
    result = invoke(["causal", "--like", "sdpa", "--fill", "min"])
    assert result.exit_code == 2 and "give one of them" in result.stderr
    result = invoke(["causal", "--like", "mha", "--dropout", 0.1])
    assert result.exit_code == 2 and "--like mha-weights" in result.stderr
    result = invoke(["causal", "--like", "keras"])
    assert result.exit_code == 2 and "'keras'" in result.stderr


def test_tutorial_weights_reproduced_independently_in_torch():
    # the tutorial's own code: seed, three Linear(3, 2) layers, causal mask by masked_fill, softmax
    x = torch.tensor(TUTORIAL_X)
    torch.manual_seed(789)
    w_query, w_key, w_value = (torch.nn.Linear(3, 2, bias=False) for _ in range(3))
    with torch.no_grad():
        queries, keys, values = w_query(x), w_key(x), w_value(x)
        scores = queries @ keys.T
        blocked = torch.triu(torch.ones(6, 6, dtype=torch.bool), diagonal=1)
        weights = torch.softmax(scores.masked_fill(blocked, -torch.inf) / keys.shape[-1] ** 0.5, dim=-1)
        context = weights @ values
    assert rounded(weights.tolist()) == TUTORIAL_WEIGHTS
    data = attend_json(["causal", "--x", json.dumps(TUTORIAL_X), "--seed", 789, "--d-out", 2])
    assert torch.allclose(tensor(data["stages"]["weights"])[0, 0], weights.double(), atol=1e-7)
    assert torch.allclose(tensor(data["stages"]["scores"])[0, 0], scores.double(), atol=1e-6)
    assert torch.allclose(tensor(data["stages"]["output"])[0, 0], context.double(), atol=1e-6)


def test_tutorial_weights_in_the_table():
    result = invoke(["causal", "--x", json.dumps(TUTORIAL_X), "--seed", 789, "--d-out", 2, "--stages", "weights"])
    assert result.exit_code == 0, result.output
    assert "inputs: --x projected by nn.Linear after torch.manual_seed(789)" in result.stdout
    lines = [line.split() for line in result.stdout.splitlines()]
    last = next(line for line in lines if line[:1] == ["5"])
    assert last == ["5", "0.1935", "0.1663", "0.1666", "0.1542", "0.1666", "0.1529"]
    first = next(line for line in lines if line[:1] == ["0"])
    assert first == ["0", "1.0000"] + ["0.0000×"] * 5


def test_tutorial_prefill_is_the_last_rows_of_the_full_causal_run():
    full = attend_json(["causal", "--x", json.dumps(TUTORIAL_X), "--seed", 789, "--d-out", 2])
    prefill = attend_json(["prefill", "--offset", 4, "--x", json.dumps(TUTORIAL_X), "--seed", 789, "--d-out", 2])
    assert prefill["shape"] == [1, 1, 2, 6] and prefill["q_offset"] == 4
    assert torch.allclose(tensor(prefill["stages"]["weights"]), tensor(full["stages"]["weights"])[:, :, 4:], atol=1e-7)


# --- given inputs against SDPA --------------------------------------------------------------


def write_safetensors(path, tensors):
    """Written by hand: 8-byte little-endian header length, JSON header, raw little-endian float32."""
    header, blobs, offset = {}, [], 0
    for name, value in tensors.items():
        raw = np.ascontiguousarray(value.numpy(), dtype="<f4").tobytes()
        header[name] = {"dtype": "F32", "shape": list(value.shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def input_args(tmp_path, fmt, tensors):
    args = []
    for name, value in tensors.items():
        path = tmp_path / f"{name}.{fmt}"
        if fmt == "pt":
            torch.save(value, path)
        elif fmt == "npy":
            np.save(path, value.numpy())
        elif fmt == "safetensors":
            write_safetensors(path, {name: value})
        elif fmt == "json":
            path.write_text(json.dumps(value.tolist()))
        args += [f"--{name}", json.dumps(value.tolist()) if fmt == "inline" else str(path)]
    return args


def sdpa(q, k, v, keep):
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=keep)


@pytest.mark.parametrize("fmt", ["pt", "npy", "safetensors", "json", "inline"])
@pytest.mark.parametrize("shape", [(5, 4), (2, 5, 4), (2, 3, 5, 4)])
def test_given_inputs_in_every_format_and_shape_are_what_the_stages_use(tmp_path, fmt, shape):
    generator = torch.Generator().manual_seed(sum(shape))
    tensors = {name: torch.randn(*shape, generator=generator) for name in "qkv"}
    if fmt in ("json", "inline"):  # JSON carries decimals: compare with what it spells
        tensors = {name: torch.tensor(value.tolist()) for name, value in tensors.items()}
    data = attend_json(["window", "--window", 2, *input_args(tmp_path, fmt, tensors)])
    four = {name: value.reshape((1,) * (4 - len(shape)) + shape) if len(shape) != 3 else value[:, None] for name, value in tensors.items()}
    batch, heads = four["q"].shape[:2]
    assert data["shape"] == [batch, heads, 5, 5] and data["params"] == {"window": 2} and data["expression"] == "window(2)"
    keep = torch.tensor(data["mask"], dtype=torch.bool)
    # the mask, independently: kv <= q and q - kv < 2
    expected_keep = torch.tensor([[kv <= q and q - kv < 2 for kv in range(5)] for q in range(5)])
    assert torch.equal(keep[0, 0], expected_keep)
    q, k, v = four["q"], four["k"], four["v"]
    scores = tensor(data["stages"]["scores"])
    assert torch.allclose(scores, (q @ k.transpose(-2, -1)).double(), atol=1e-5)
    output = tensor(data["stages"]["output"])
    assert output.shape == (batch, heads, 5, 4)
    assert (output - sdpa(q, k, v, expected_keep).double()).abs().max().item() <= 1e-6


def test_given_inputs_decide_the_length_and_a_disagreeing_len_names_the_dimension(tmp_path):
    q = torch.randn(4, 3)
    args = input_args(tmp_path, "npy", {"q": q, "k": torch.randn(4, 3), "v": torch.randn(4, 3)})
    assert attend_json(["causal", *args])["shape"] == [1, 1, 4, 4]
    result = invoke(["causal", "--len", 5, *args])
    assert result.exit_code == 2
    assert result.stderr == "maskcli: error: inputs' query length (dim -2 of q) is 4 but the mask has 5: match --len/--offset/labels to the inputs\n"


def test_keys_longer_than_queries_for_prefill(tmp_path):
    generator = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(2, 3, generator=generator), torch.randn(5, 3, generator=generator), torch.randn(5, 3, generator=generator)
    args = input_args(tmp_path, "pt", {"q": q, "k": k, "v": v})
    data = attend_json(["prefill", "--offset", 3, *args])
    assert data["shape"] == [1, 1, 2, 5]
    keep = torch.tensor([[kv <= 3 + i for kv in range(5)] for i in range(2)])
    assert torch.allclose(tensor(data["stages"]["output"])[0, 0], sdpa(q, k, v, keep).double(), atol=1e-6)
    result = invoke(["prefill", "--offset", 2, *args])
    assert result.exit_code == 2
    assert "key length (dim -2 of k) is 5 but the mask has 4" in result.stderr


# --- bad input: exit 2, one line, no traceback ----------------------------------------------


class Planter:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def assert_one_line_error(result, *fragments):
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith("maskcli: error: "), result.stderr
    assert result.stderr.endswith("\n") and result.stderr.count("\n") == 1, result.stderr
    assert result.stdout == ""
    assert "Traceback" not in result.output and "Traceback" not in result.stderr
    for fragment in fragments:
        assert fragment in result.stderr, (fragment, result.stderr)


def test_malicious_pickle_is_refused_and_never_run(tmp_path):
    marker = tmp_path / "planted"
    evil = tmp_path / "evil.pt"
    torch.save({"q": Planter(marker)}, evil)
    result = invoke(["causal", "--q", evil, "--k", evil, "--v", evil])
    assert_one_line_error(result, "evil.pt", "refused to load with weights_only=True, nothing in it was run")
    assert not marker.exists()
    bare = tmp_path / "bare.pt"
    torch.save(Planter(marker), bare)
    assert_one_line_error(invoke(["causal", "--x", bare]), "--x", "refused")
    assert not marker.exists()


def test_bad_files_and_shapes(tmp_path):
    good = json.dumps([[1.0, 2.0], [3.0, 4.0]])
    (tmp_path / "empty.npy").write_bytes(b"")
    (tmp_path / "corrupt.npy").write_bytes(b"\x93NUMPY\x01\x00\xff\x00{'descr': '<f4', 'fortran_order'")
    (tmp_path / "text.npy").write_bytes(b"1 2 3\n")
    np.save(tmp_path / "five.npy", np.zeros((1, 1, 1, 2, 2), dtype=np.float32))
    (tmp_path / "ragged.json").write_text("[[1, 2], [3]]")
    cases = [
        (["--q", tmp_path / "missing.pt", "--k", good, "--v", good], ["--q", "missing.pt", "no such file"]),
        (["--q", tmp_path / "empty.npy", "--k", good, "--v", good], ["empty.npy", "the file is empty"]),
        (["--q", good, "--k", tmp_path / "corrupt.npy", "--v", good], ["--k", "corrupt.npy", "not a readable numpy file"]),
        (["--q", good, "--k", good, "--v", tmp_path / "text.npy"], ["--v", "text.npy", "not a numpy file"]),
        (["--q", tmp_path / "five.npy", "--k", good, "--v", good], ["--q has shape [1, 1, 1, 2, 2]", "expected [L, D], [B, L, D] or [B, H, L, D]"]),
        (["--x", tmp_path / "five.npy"], ["--x has shape [1, 1, 1, 2, 2]"]),
        (["--q", good, "--k", good, "--v", tmp_path / "ragged.json"], ["ragged.json", "not a rectangular nested list"]),
        (["--q", good, "--k", good, "--v", "[[1, 2], [3"], ["--v '[[1, 2], [3' (inline JSON): not valid JSON"]),
        (["--q", good], ["give all of --q, --k and --v (missing --k, --v)"]),
        (["--v", good, "--k", good], ["missing --q"]),
    ]
    for args, fragments in cases:
        assert_one_line_error(invoke(["causal", *args]), *fragments)


def test_lengths_that_disagree_with_the_mask_name_the_dimension():
    two = json.dumps([[1.0, 0.0], [0.0, 1.0]])
    three = json.dumps([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    assert_one_line_error(invoke(["causal", "--q", two, "--k", three, "--v", three]), "key length (dim -2 of k) is 3 but the mask has 2")
    assert_one_line_error(invoke(["causal", "--q", two, "--k", two, "--v", three]), "value length (dim -2 of v) is 3 but the mask has 2")
    assert_one_line_error(invoke(["chunk", "--chunks", "0,0,1", "--q", two, "--k", two, "--v", two]), "query length (dim -2 of q) is 2 but the mask has 3")
    four_rows = json.dumps(TUTORIAL_X[:4])
    for args in (["causal", "--len", 3], ["prefill", "--offset", 1, "--len", 5], ["chunk", "--chunks", "0,1,1"]):
        assert_one_line_error(invoke([*args, "--x", four_rows]), "--x has 4 rows (dim -2, one per token) but the mask has")
    narrow = json.dumps([[1.0], [0.0]])
    assert_one_line_error(invoke(["causal", "--q", two, "--k", narrow, "--v", two]), "head sizes differ (2 vs 1, dim -1)")
    batch3 = json.dumps(torch.zeros(3, 2, 2).tolist())
    assert_one_line_error(
        invoke(["padding", "--lengths", "2,1", "--q", batch3, "--k", batch3, "--v", batch3]),
        "batch (dim 0) does not agree: q 3, k/v 3, mask 2",
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="cuda is available here")
def test_devices_that_are_not_here_list_the_available_ones():
    assert_one_line_error(invoke(["causal", "--len", 3, "--device", "tpu"]), "unknown --device 'tpu'", "cpu")
    assert_one_line_error(invoke(["causal", "--len", 3, "--device", "cuda"]), "--device 'cuda' is not available here; available: cpu")
    assert_one_line_error(invoke(["causal", "--len", 3, "--device", "cuda:1"]), "--device 'cuda:1' is not available here; available: cpu")


@pytest.mark.parametrize(
    "args, fragments",
    [
        (["--dtype", "float8"], ["unknown --dtype 'float8'", "float32, float16, bfloat16, float64"]),
        (["--dtype", "int64"], ["unknown --dtype 'int64'"]),
        (["--fill", "-1e10"], ["unknown --fill '-1e10'", "-inf, min, -1e9, multiply"]),
        (["--fill", "zero"], ["unknown --fill 'zero'"]),
        (["--stages", "scores,logits"], ["unknown stage in --stages 'logits'"]),
        (["--stages", ","], ["--stages ',' names no stage"]),
        (["--dropout", "1"], ["--dropout must be at least 0 and below 1"]),
        (["--scale", "0"], ["--scale must be a positive finite number"]),
        (["--png", "out.gif"], ["--png 'out.gif': unknown extension '.gif'"]),
        (["--head", "3"], ["--head 3 is outside this run's heads 0-0 (H=1): pick one of them"]),
        (["--batch-index", "-1"], ["--batch-index -1 is outside this run's batch rows 0-0 (B=1)"]),
        (["--d-out", "3", "--heads", "2", "--x", json.dumps(TUTORIAL_X[:3])], ["--d-out 3 does not split into --heads 2"]),
        (["--d-out", "0", "--x", json.dumps(TUTORIAL_X[:3])], ["--d-out must be at least 1", "got 0"]),
        # options the inputs in use would ignore are refused, not ignored
        (["--d-out", "2"], ["--d-out 2 is for the projections of --x embeddings", "drop --d-out"]),
        (["--qkv-bias"], ["--qkv-bias is for the projections of --x embeddings", "drop --qkv-bias"]),
        (["--head-dim", "4", "--x", json.dumps(TUTORIAL_X[:3])], ["--head-dim 4 is for random inputs", "--d-out / --heads"]),
        (["--batch", "2", "--x", json.dumps(TUTORIAL_X[:3])], ["--batch 2 is for random inputs, and --x set the batch size"]),
        (["--batch", "3", "--lengths", "3,1"], ["--batch 3 does not match the 2 batch rows of the mask (--lengths/--ids or labels): drop --batch"]),
        (["--png", ""], ["--png is empty: give a file name"]),
        (["--html", ""], ["--html is empty: give a file name"]),
        (["--html", "out.htm"], ["--html 'out.htm': unknown extension '.htm'; use one of .html"]),
        (["--html", "nodir/a.html"], ["--html 'nodir/a.html': directory 'nodir' does not exist"]),
        (["--seed", str(2**64)], [f"--seed must be 0 to {2**63 - 1}", str(2**64)]),
        (["--seed", "-1"], ["--seed must be 0 to"]),
        (["--scale", "inf"], ["--scale must be a positive finite number, got inf"]),
        (["--lengths", "3,3,2", "--q", json.dumps([TUTORIAL_X[:3]] * 2), "--k", json.dumps(TUTORIAL_X[:3]), "--v", json.dumps(TUTORIAL_X[:3])],
         ["batch (dim 0) does not agree: q 2, k/v 1, mask 3 (from the rows of --lengths/--ids); each must be 1 or 3"]),
        (["--q", "missing.npy", "--k", "[[1]]", "--v", "[[1]]"], ["--q 'missing.npy': no such file (give a .pt"]),
        (["--q", "", "--k", "[[1]]", "--v", "[[1]]"], ["--q ''"]),
    ],
)
def test_bad_options_are_one_line(args, fragments, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert_one_line_error(invoke(["causal", "--len", 3, *args]), *fragments)
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_q_k_v_take_precedence_over_x_and_say_so():
    q = [[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]
    result = invoke(["causal", "--q", json.dumps(q), "--k", json.dumps(q), "--v", json.dumps(q), "--x", json.dumps(TUTORIAL_X[:3]), "--json"])
    assert result.exit_code == 0, result.output
    assert result.stderr == "maskcli: warning: --x is ignored: --q/--k/--v take precedence\n"
    data = json.loads(result.stdout)
    expected = sdpa(torch.tensor(q), torch.tensor(q), torch.tensor(q), torch.ones(3, 3, dtype=torch.bool).tril())
    assert torch.allclose(tensor(data["stages"]["output"])[0, 0], expected.double(), atol=1e-6)


def test_batch_that_matches_the_padding_is_accepted():
    data = attend_json(["causal", "--len", 3, "--lengths", "3,1", "--batch", 2])
    assert data["shape"] == [2, 1, 3, 3]


# --- JSON -----------------------------------------------------------------------------------


def test_json_has_every_stage_as_nested_lists_and_spells_non_finite_values():
    data = attend_json(["padding", "--lengths", "3,0", "--fill", "-inf"])
    assert data["device"] == "cpu" and data["dtype"] == "float32" and data["fill"] == "-inf"
    assert data["shape"] == [2, 1, 3, 3] and data["scale"] == pytest.approx(1 / math.sqrt(8))
    assert data["head_dim"] == 8 and data["tokens"] is None
    assert attend_json(["causal", "--len", 2, "--tokens", "hello world"])["tokens"] == ["hello", "world"]
    assert data["mask"] == [[[[1, 1, 1]] * 3], [[[0, 0, 0]] * 3]]
    assert list(data["stages"]) == ["scores", "scaled", "unmasked", "masked", "weights", "output"]
    for name in STAGE_NAMES:
        width = 8 if name == "output" else 3
        values = data["stages"][name]
        assert len(values) == 2 and all(len(b) == 1 and len(b[0]) == 3 and all(len(r) == width for r in b[0]) for b in values), name
        assert all(isinstance(x, float) for x in np.ravel(values[0]).tolist()), name  # batch 0 sees every key
    assert data["stages"]["masked"][1][0] == [["-inf"] * 3] * 3
    assert data["stages"]["weights"][1][0] == [["nan"] * 3] * 3
    assert data["stages"]["output"][1][0] == [["nan"] * 8] * 3
    assert isinstance(data["stages"]["scores"][1][0][0][0], float)  # scores come before the mask
    assert [f["code"] for f in data["findings"]] == ["fully-masked"]
    assert "NaN" in data["findings"][0]["message"]
    # the strings are JSON strings, not bare NaN tokens that strict parsers refuse
    raw = invoke(["padding", "--lengths", "3,0", "--json"]).stdout

    def refuse(token):
        raise AssertionError(f"bare {token} in the JSON")

    json.loads(raw, parse_constant=refuse)
    assert '"nan"' in raw and '"-inf"' in raw


def test_json_uniform_rows_under_min_and_minus_1e9():
    for fill in ("min", "-1e9"):
        data = attend_json(["padding", "--lengths", "3,0", "--fill", fill])
        assert tensor(data["stages"]["weights"])[1].flatten().tolist() == [1 / 3] * 9 or torch.allclose(
            tensor(data["stages"]["weights"])[1], torch.full((1, 3, 3), 1 / 3, dtype=torch.float64), atol=1e-7
        )
        expected = torch.finfo(torch.float32).min if fill == "min" else -1e9
        assert set(np.ravel(data["stages"]["masked"][1]).tolist()) == {expected}
        assert [f["code"] for f in data["findings"]] == ["fully-masked"]
        assert "uniform" in data["findings"][0]["message"]


@pytest.mark.parametrize("dtype", ["float64", "float32", "float16", "bfloat16"])
def test_hf_eager_fully_masked_rows_per_dtype(dtype):
    # Hugging Face adds finfo(dtype).min and takes the softmax in float32: finite there except float64's
    data = attend_json(["causal", "--ids", "0,0,5,6", "--like", "hf-eager", "--dtype", dtype])
    masked = tensor(data["stages"]["masked"])[0, 0]
    assert masked[0].tolist() == [torch.finfo(getattr(torch, dtype)).min] * 4
    weights = tensor(data["stages"]["weights"])[0, 0, :2]
    [finding] = data["findings"]
    assert finding["code"] == "fully-masked" and finding["message"].startswith("query rows 0-1 see no key")
    if dtype == "float64":
        assert torch.isnan(weights).all()
        assert "finfo(float64).min is -inf in the float32 softmax" in finding["message"]
    else:
        assert torch.equal(weights, torch.full((2, 4), 0.25, dtype=torch.float64))
        assert "uniform (1/4 on every key)" in finding["message"]


def test_json_float16_minus_1e9_overflow_is_reported():
    data = attend_json(["padding", "--lengths", "3,0", "--fill", "-1e9", "--dtype", "float16"])
    assert data["dtype"] == "float16"
    assert data["stages"]["masked"][1][0] == [["-inf"] * 3] * 3
    assert [f["code"] for f in data["findings"]] == ["fill-overflow", "fully-masked"]


def test_json_dtype_float64_computes_in_float64():
    generator = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(4, 8, generator=generator, dtype=torch.float64) for _ in range(3))
    args = ["--q", json.dumps(q.tolist()), "--k", json.dumps(k.tolist()), "--v", json.dumps(v.tolist())]
    keep = torch.tril(torch.ones(4, 4, dtype=torch.bool))
    # JSON numbers are doubles and stay so: the float64 run computes on exactly these numbers
    reference = torch.softmax((q @ k.T / math.sqrt(8)).masked_fill(~keep, -math.inf), dim=-1)
    data64 = attend_json(["causal", *args, "--dtype", "float64"])
    data32 = attend_json(["causal", *args, "--dtype", "float32"])
    assert data64["dtype"] == "float64" and data32["dtype"] == "float32"
    assert (tensor(data64["stages"]["weights"])[0, 0] - reference).abs().max().item() <= 1e-14
    assert (tensor(data64["stages"]["output"])[0, 0] - reference @ v).abs().max().item() <= 1e-13
    # float32 rounding shows at float64 precision: the two runs are not the same numbers
    diff32 = (tensor(data32["stages"]["weights"])[0, 0] - reference).abs().max().item()
    assert 1e-12 < diff32 <= 1e-6


@pytest.mark.parametrize("dtype, eps", [("float16", 2**-10), ("bfloat16", 2**-7)])
def test_json_half_dtypes_name_themselves_and_round(dtype, eps):
    data = attend_json(["causal", "--len", 5, "--dtype", dtype])
    assert data["dtype"] == dtype and data["device"] == "cpu"
    weights = tensor(data["stages"]["weights"])
    reference = tensor(attend_json(["causal", "--len", 5, "--dtype", "float64"])["stages"]["weights"])
    assert (weights - reference).abs().max().item() <= 8 * eps
    # every number is one the dtype can hold
    torch_dtype = getattr(torch, dtype)
    assert torch.equal(weights.to(torch_dtype).double(), weights)


def test_json_dropout_row_sum_and_the_mask_convention():
    data = attend_json(["causal", "--len", 6, "--dropout", 0.5, "--seed", 2])
    assert data["dropout"] == 0.5
    assert [f["code"] for f in data["findings"]] == ["row-sum"]
    weights = tensor(data["stages"]["weights"])
    assert set(torch.unique(weights[torch.tensor(data["mask"], dtype=torch.bool)] == 0).tolist()) == {False, True}


def test_json_sees_later_for_triu_read_as_keep_and_not_as_block():
    data = attend_json(["triu", "--len", 4, "--means", "keep"])
    codes = [f["code"] for f in data["findings"]]
    assert "sees-later" in codes and "fully-masked" in codes
    assert data["mask"][0][0] == [[0, 1, 1, 1], [0, 0, 1, 1], [0, 0, 0, 1], [0, 0, 0, 0]]  # torch.triu(ones, 1)
    block = attend_json(["triu", "--len", 4])
    assert block["findings"] == [] and block["mask"][0][0] == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]]
    assert attend_json(["tril", "--len", 4, "--means", "block"])["findings"][0]["code"] == "sees-later"


def test_findings_in_the_table_output():
    result = invoke(["padding", "--lengths", "3,0", "--fill", "-1e9", "--dtype", "float16", "--stages", "weights"])
    assert result.exit_code == 0, result.output
    assert "device cpu · dtype float16" in result.stdout
    assert "fill -1e9 does not fit float16" in result.stdout
    assert "query rows 0-2 see no key (batch 1)" in result.stdout
    clean = invoke(["causal", "--len", 3])
    assert clean.exit_code == 0, clean.output
    assert "findings: none" in clean.stdout


def test_stages_and_precision_choose_what_the_tables_show():
    result = invoke(["causal", "--len", 3, "--stages", "weights,scaled", "--precision", 2])
    assert result.exit_code == 0, result.output
    titles = [line.strip() for line in result.stdout.splitlines() if line.split(" =")[0] in STAGE_NAMES]
    assert titles == ["weights = softmax(masked)", "scaled = scores × 0.353553"]  # 1/sqrt(8)
    row0 = next(line.split() for line in result.stdout.splitlines() if line.split()[:2] == ["0", "1.00"])
    assert row0 == ["0", "1.00", "0.00×", "0.00×"]


# --- the figure -----------------------------------------------------------------------------


def figure_cells(tmp_path, args, names):
    """Write the figure through the CLI; rebuild the same figure in-process to learn where each cell is drawn."""
    import matplotlib.image as mpimg

    from maskcli.render import stages as report
    from maskcli.attention.inputs import make_qkv
    from maskcli.attention.run import run_attention
    from flags import from_flags

    path = tmp_path / "stages.png"
    result = invoke([*args, "--stages", ",".join(names), "--png", path])
    assert result.exit_code == 0, result.output
    assert f"wrote {path}" in result.stderr
    image = mpimg.imread(path)
    kind, options = args[0], dict(zip(args[1::2], args[2::2]))
    spec = from_flags(kind, length=options.get("--len"), lengths=options.get("--lengths"))
    qkv = make_qkv(None, seed=0, batch=spec.batch, heads=1, head_dim=8, d_out=None, qkv_bias=False, q_len=spec.frame.q_len, k_len=spec.frame.k_len)
    run = run_attention(spec, qkv, torch.device("cpu"), torch.float32, fill=options.get("--fill", "-inf"))
    from maskcli.commands.attend import FIGURE_ROWS

    pairs = report.selection(run.stages.keep.shape, None, None, limit=FIGURE_ROWS)
    figure = report.stages_figure(run.mask, run.stages, names, pairs, run.device)
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(figure)  # a bare Figure's canvas does not draw, and so would not lay itself out
    figure.set_dpi(100)  # what save_figure writes with
    figure.canvas.draw()
    width, height = figure.canvas.get_width_height()
    assert image.shape[:2] == (height, width)
    return image, figure, run, pairs


def pixel(image, ax, x, y):
    """RGB 0-255 of the image at data coordinates (x = column, y = row) of axes `ax`."""
    px, py = ax.transData.transform((x, y))
    return np.round(image[int(image.shape[0] - py), int(px), :3] * 255).astype(int)


def is_grey(rgb):
    from maskcli.render.heatmaps import MASKED_RGB

    return bool(np.abs(rgb - np.array(MASKED_RGB)).max() <= 2)


def test_png_masked_cells_are_grey_and_visible_cells_are_not(tmp_path):
    # 13 positions: past the size where values are written in the cells, so each cell is one colour
    names = ["masked", "weights"]
    image, figure, run, _ = figure_cells(tmp_path, ["causal", "--len", 13], names)
    axes = figure.axes[: len(names)]  # colour bars come after the panels
    keep = run.stages.keep[0, 0]
    for ax, name in zip(axes, names):
        assert ax.get_title() == name
        for i in range(13):
            for j in range(13):
                for dx, dy in ((0, 0), (0.25, -0.25), (-0.25, 0.25)):
                    rgb = pixel(image, ax, j + dx, i + dy)
                    assert is_grey(rgb) == (not bool(keep[i, j])), (name, i, j, rgb.tolist())


def test_png_padding_heads_by_stages_with_values_written(tmp_path):
    # two batch rows x two stages: a grid of rows (batch, head) by columns (stages)
    names = ["scores", "weights"]
    image, figure, run, pairs = figure_cells(tmp_path, ["padding", "--lengths", "4,2"], names)
    assert pairs == [(0, 0), (1, 0)]
    panels = figure.axes[: len(pairs) * len(names)]
    titles = [ax.get_title() for ax in panels]
    assert titles == [f"b{b} h0: {n}" for b in (0, 1) for n in names]
    for index, ax in enumerate(panels):
        b, name = pairs[index // len(names)][0], names[index % len(names)]
        keep = run.stages.keep[b, 0]
        for i in range(4):
            for j in range(4):
                rgb = pixel(image, ax, j - 0.35, i - 0.35)  # a corner, away from the value text
                if name == "scores":  # scores exist under the mask: hatched over, not plain grey
                    assert not is_grey(rgb), (name, b, i, j)
                else:
                    assert is_grey(rgb) == (not bool(keep[i, j])), (name, b, i, j, rgb.tolist())
    # and a crude whole-image check: at least the masked cells' share of the weights panel is grey
    from maskcli.render.heatmaps import MASKED_RGB

    grey = (np.abs(np.round(image[..., :3] * 255) - np.array(MASKED_RGB)).max(axis=-1) <= 2).mean()
    assert grey > 0.01


def test_png_masked_cells_that_still_carry_weight_are_red_and_named(tmp_path):
    # --fill min on a batch row that sees no key: uniform weights on masked cells, which the figure must not hide
    from maskcli.render.heatmaps import LEAK_RGB

    names = ["weights"]
    image, figure, run, pairs = figure_cells(tmp_path, ["padding", "--lengths", "3,0", "--fill", "min"], names)
    assert pairs == [(0, 0), (1, 0)]
    row0, row1 = figure.axes[:2]  # colour bars come after the panels
    assert (row0.get_title(), row1.get_title()) == ("b0 h0: weights", "b1 h0: weights")
    weights = run.stages.weights
    assert torch.allclose(weights[1, 0], torch.full((3, 3), 1 / 3))  # independent of the figure: uniform
    for i in range(3):
        for j in range(3):
            assert np.abs(pixel(image, row1, j - 0.35, i - 0.35) - np.array(LEAK_RGB)).max() <= 2, (i, j)
            assert np.abs(pixel(image, row0, j - 0.35, i - 0.35) - np.array(LEAK_RGB)).max() > 60, (i, j)
    legend = [text.get_text() for text in figure.legends[0].get_texts()]
    assert legend[:2] == ["grey: masked, this query may not look at this key (×)", "masked, yet weighted (a row that sees no key)"]
    assert legend[2].startswith("padding")  # batch row 1 is all padding: the marks say so


def test_png_with_fill_min_writes_no_warnings(tmp_path):
    # finfo.min in the masked stage once overflowed matplotlib's colour scaling (RuntimeWarning on stderr)
    path = tmp_path / "min.png"
    result = invoke(["padding", "--lengths", "3,0", "--fill", "min", "--png", path])
    assert result.exit_code == 0, result.output
    assert result.stderr == f"wrote {path}\n"


def test_png_rows_are_labelled_and_capped_with_a_note(tmp_path):
    path = tmp_path / "many.png"
    result = invoke(["causal", "--len", 3, "--heads", 5, "--lengths", "3,2", "--stages", "weights", "--png", path])
    assert result.exit_code == 0, result.output
    assert result.stderr == (
        f"wrote {path} (the figure's rows show b0 h0, b0 h1, b0 h2, b0 h3, b1 h0, b1 h1, b1 h2, b1 h3 of 10 (batch, head) "
        "pairs (B=2, H=5): choose with --batch-index and --head)\n"
    )
    chosen = tmp_path / "one.png"
    result = invoke(["causal", "--len", 3, "--heads", 5, "--lengths", "3,2", "--batch-index", 1, "--head", 4, "--png", chosen])
    assert result.exit_code == 0 and result.stderr == f"wrote {chosen}\n", result.output


def test_tables_say_which_heads_they_leave_out():
    result = invoke(["causal", "--len", 2, "--heads", 6, "--stages", "weights"])
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert "the tables show b0 h0, b0 h1, b0 h2, b0 h3 of 6 (batch, head) pairs (B=1, H=6): choose with --batch-index and --head" in " ".join(result.stdout.split())
    assert [line for line in lines if line.startswith("weights")] == [f"weights = softmax(masked) — head {h}" for h in range(4)]
    one = invoke(["causal", "--len", 2, "--heads", 6, "--head", 5, "--stages", "weights"])
    assert [line for line in one.stdout.splitlines() if line.startswith("weights")] == ["weights = softmax(masked) — head 5"]
    assert "the tables show" not in one.stdout
    # left to choose, every batch row (whose masks differ) comes before a second head (whose masks do not)
    padded = invoke(["causal", "--len", 2, "--heads", 4, "--lengths", "2,1,0", "--stages", "weights"])
    titles = [line for line in padded.stdout.splitlines() if line.startswith("weights")]
    assert titles == [f"weights = softmax(masked) — batch {b}, head {h}" for b, h in ((0, 0), (0, 1), (1, 0), (2, 0))]


def test_a_wide_stage_shows_the_columns_that_fit_and_says_so():
    # weights cells are "0.1234×": 7 characters + 2 of padding; the label column "q \ kv" takes 8; "…" 3
    result = invoke(["causal", "--len", 20, "--stages", "weights"], env={"COLUMNS": "60"})
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    header = next(line for line in lines if line.startswith(" q \\ kv"))
    assert header.split() == ["q", "\\", "kv", "0", "1", "2", "3", "4", "…"]
    assert max(map(len, lines[3:])) <= 60
    assert "keys 0-4 of 20 shown: --png draws every cell, --json prints every value" in " ".join(result.stdout.split())
    # the values shown are the run's own, cell for cell
    data = attend_json(["causal", "--len", 20])
    row = next(line.split() for line in lines if line.split()[:1] == ["3"])
    assert row == ["3"] + [f"{w:.4f}" + ("" if j <= 3 else "×") for j, w in enumerate(data["stages"]["weights"][0][0][3][:5])] + ["…"]


def test_a_long_stage_shows_its_first_rows_and_says_so():
    from maskcli.render.stages import MAX_TABLE_ROWS

    length = MAX_TABLE_ROWS + 6
    result = invoke(["causal", "--len", length, "--stages", "output"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    rows = [line.split()[0] for line in result.stdout.splitlines() if line.split() and (line.split()[0].isdigit() or line.split()[0] == "⋮")]
    assert rows == [str(i) for i in range(MAX_TABLE_ROWS)] + ["⋮"]
    assert f"queries 0-{MAX_TABLE_ROWS - 1} of {length} shown" in " ".join(result.stdout.split())
    assert "dims" not in result.stdout  # every head dim is shown
    both = invoke(["prefill", "--offset", 3, "--len", length, "--stages", "weights"], env={"COLUMNS": "60"})
    assert f"keys 0-4 of {length + 3} and queries 3-{MAX_TABLE_ROWS + 2} of {length} shown" in " ".join(both.stdout.split())


def test_min_fill_in_float64_prints_finfo_min_not_minus_inf():
    result = invoke(["causal", "--len", 2, "--fill", "min", "--dtype", "float64", "--stages", "masked"])
    assert result.exit_code == 0, result.output
    row0 = next(line.split() for line in result.stdout.splitlines() if line.split()[:1] == ["0"])
    assert row0[2] == f"{torch.finfo(torch.float64).min:.2e}×" == "-1.80e+308×"
    assert "-inf" not in result.stdout.replace("set to finfo.min", "")


def test_maskcli_device_sets_the_default_device_and_the_flag_wins(monkeypatch):
    monkeypatch.setenv("MASKCLI_DEVICE", "tpu")
    assert_one_line_error(invoke(["causal", "--len", 2]), "unknown --device 'tpu'")
    result = invoke(["causal", "--len", 2, "--device", "cpu", "--json"])
    assert result.exit_code == 0 and json.loads(result.stdout)["device"] == "cpu", result.output


def test_running_out_of_memory_midway_is_one_line(monkeypatch):
    from maskcli.attention import run

    def exhausted(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")

    monkeypatch.setattr(run, "attend", exhausted)
    assert_one_line_error(invoke(["causal", "--len", 4, "--heads", 2]), "cpu ran out of memory for the attention stages (1 x 2 x 4 x 4 cells each)", "--len")


def test_a_file_holding_a_list_is_refused_on_one_line(tmp_path):
    torch.save([torch.ones(3, 3)], tmp_path / "list.pt")  # the list's repr spans lines
    path = str(tmp_path / "list.pt")
    assert_one_line_error(invoke(["causal", "--q", path, "--k", path, "--v", path]), "holds list [tensor(", "not a tensor or a dict of tensors")


def test_json_inputs_keep_double_precision_until_the_compute_dtype():
    q = [[1.0000000001, 2.0], [3.0, 4.0]]
    data = attend_json(["causal", "--q", json.dumps(q), "--k", json.dumps(q), "--v", json.dumps(q), "--dtype", "float64"])
    expected = torch.tensor(q, dtype=torch.float64) @ torch.tensor(q, dtype=torch.float64).T  # independent, in float64
    assert tensor(data["stages"]["scores"])[0, 0].tolist() == expected.tolist()
    assert data["stages"]["scores"][0][0][0][0] == 1.0000000001**2 + 4 != 5.0


@pytest.mark.parametrize("args, fragment", [
    (["--q", "[[1e39,2],[3,4]]", "--k", "[[1,2],[3,4]]", "--v", "[[1,2],[3,4]]"], "--q holds 1e+39, beyond what float32 holds (largest 3.40282e+38)"),
    (["--q", "[[1,2],[3,4]]", "--k", "[[70000,2],[3,4]]", "--v", "[[1,2],[3,4]]", "--dtype", "float16"], "--k holds 70000, beyond what float16 holds (largest 65504)"),
    (["--x", "[[1e39,2],[3,4]]"], "--x holds 1e+39, beyond what float32 holds"),
])
def test_inputs_beyond_the_dtype_are_refused_not_turned_to_inf(args, fragment):
    assert_one_line_error(invoke(["causal", *args]), fragment)
    if "--q" in args and "--dtype" not in args:  # the same numbers fit float64
        assert invoke(["causal", *args, "--dtype", "float64"]).exit_code == 0


def test_precision_0_prints_whole_numbers_only():
    data = attend_json(["causal", "--len", 3])
    result = invoke(["causal", "--len", 3, "--stages", "weights", "--precision", 0])
    row2 = next(line.split() for line in result.stdout.splitlines() if line.split()[:1] == ["2"])
    assert row2 == ["2"] + [f"{w:.0f}" for w in data["stages"]["weights"][0][0][2]]
    assert "e-" not in result.stdout


def test_stages_too_big_for_memory_are_refused_with_what_attend_can_change(monkeypatch):
    from maskcli import memory

    monkeypatch.setattr(memory, "available_memory", lambda device=None: 10_000)
    assert_one_line_error(
        invoke(["causal", "--len", 64, "--heads", 2]),
        "1 x 2 x 64 x 64 attention cells (head dim 8) would need", "use a smaller --len, fewer --heads or --batch, a smaller --head-dim, or a smaller --dtype",
    )


def test_an_expression_behind_a_cache_runs_through_its_own_cells():
    data = attend_json(["document(0,0,1,1,1,1) & window(2) | sink(1)", "--offset", 3, "--seed", 2])
    assert data["expression"] == "document(0,0,1,1,1,1) & window(2) | sink(1)"
    assert (data["shape"], data["q_offset"], data["kv_offset"]) == ([1, 1, 3, 6], 3, 0)
    labels = [0, 0, 1, 1, 1, 1]
    expected = [[int((labels[q] == labels[kv] and q - 2 < kv <= q) or kv < 1) for kv in range(6)] for q in range(3, 6)]
    assert data["mask"] == [[expected]]
    header = invoke(["document(0,0,1,1,1,1) & window(2) | sink(1)", "--offset", 3, "--stages", "weights"], env={"COLUMNS": "200"}).stdout.splitlines()[0]
    assert header == "attend document(0,0,1,1,1,1) & window(2) | sink(1) · shape (B=1, H=1, Lq=3, Lk=6, D=8) · queries 3-5 · keys 0-5"


def test_attend_through_a_mask_file_with_given_inputs_equals_sdpa(tmp_path):
    keep = torch.ones(3, 5, dtype=torch.bool).tril(2)
    keep[1, 0] = False  # not a kind maskcli has: the file is the mask
    torch.save(torch.zeros(1, 1, 3, 5).masked_fill(~keep, float("-inf")), tmp_path / "m.pt")
    generator = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(3, 4, generator=generator), torch.randn(5, 4, generator=generator), torch.randn(5, 4, generator=generator)
    for name, value in (("q", q), ("k", k), ("v", v)):
        torch.save(value, tmp_path / f"{name}.pt")
    data = attend_json(["--mask", tmp_path / "m.pt", "--q", tmp_path / "q.pt", "--k", tmp_path / "k.pt", "--v", tmp_path / "v.pt"])
    expected = torch.nn.functional.scaled_dot_product_attention(q[None, None], k[None, None], v[None, None], attn_mask=keep)
    torch.testing.assert_close(torch.tensor(data["stages"]["output"], dtype=torch.float32)[0, 0], expected[0, 0])
    assert data["mask"] == [[keep.int().tolist()]]


def test_png_weights_share_one_fixed_0_to_1_scale(tmp_path):
    # two batch rows (padding lengths 4,2): every weights panel colours a weight w as viridis(w), whatever
    # the panel's own range, so a dark cell means a small weight everywhere
    import matplotlib

    image, figure, run, pairs = figure_cells(tmp_path, ["padding", "--lengths", "4,2"], ["weights"])
    viridis = matplotlib.colormaps["viridis"]
    weights = run.stages.weights
    for ax, (b, h) in zip(figure.axes, pairs):
        for i in range(4):
            for j in range(4 if b == 0 else 2):
                expected = np.round(np.array(viridis(float(weights[b, h, i, j]))[:3]) * 255)
                assert np.abs(pixel(image, ax, j - 0.35, i - 0.35) - expected).max() <= 3, (b, i, j)
    # one colour bar for both panels, labelled, from 0 to 1
    bars = [ax for ax in figure.axes if ax.get_label() == "<colorbar>"]
    assert len(bars) == 1 and bars[0].get_ylim() == (0.0, 1.0) and bars[0].get_ylabel().startswith("weight")


def test_png_panels_of_a_row_line_up_their_query_rows(tmp_path):
    # a 40-token run: the output panel (queries x head dims) is tall and thin beside square key panels;
    # query row i must sit at the same height in every panel of the row
    image, figure, run, pairs = figure_cells(tmp_path, ["causal", "--len", 40], ["scores", "weights", "output"])
    panels = [ax for ax in figure.axes if ax.get_title() in ("scores", "weights", "output")]
    assert len(panels) == 3
    for row in (0, 20, 39):
        heights = [ax.transData.transform((0, row))[1] for ax in panels]
        assert max(heights) - min(heights) <= 1.0, heights


def _floats(nested):
    return np.array(nested, dtype=object).astype(str).astype(float)  # "-inf", "nan" as JSON spells them


@pytest.mark.parametrize("extra", [[], ["--dropout", "0.5"], ["--lengths", "40,30", "--like", "hf-eager"]])
def test_a_region_is_the_whole_runs_stages_there(extra):
    args = ["attend", "document(sizes=[24,16]) & window(6)", "--json", *extra]
    whole = json.loads(runner.invoke(app, args, env={"MASKCLI_DEVICE": "cpu"}).stdout)
    result = runner.invoke(app, [*args, "--rows", "20:28", "--keys", "18:"], env={"MASKCLI_DEVICE": "cpu"})
    assert result.exit_code == 0, result.output
    part = json.loads(result.stdout)
    for stage in ("scores", "masked", "weights"):  # the softmax is over every key; the region only shows some
        expected = _floats(whole["stages"][stage] if "stages" in whole else whole[stage])[:, :, 20:28, 18:]
        got = _floats(part["stages"][stage] if "stages" in part else part[stage])
        # only the rows asked for are computed: a BLAS may sum a slice's dot products in another order
        assert np.allclose(got, expected, rtol=1e-5, atol=1e-6, equal_nan=True), stage
    out = runner.invoke(app, ["attend", "causal", "--len", "8", "--rows", "6:", "--keys", ":3", "--stages", "weights"],
                        env={"MASKCLI_DEVICE": "cpu", "COLUMNS": "100"}).stdout
    assert " q \\ kv " in out and "\n 6 " in out and "\n 5 " not in out and " 3 " not in out.split("weights =")[1].splitlines()[1]


def test_html_embeds_the_stages_it_shows(tmp_path):
    path = tmp_path / "a.html"
    result = invoke(["causal", "--len", 3, "--stages", "masked,weights", "--html", path])
    assert result.exit_code == 0 and f"wrote {path}" in result.stderr
    page = path.read_text()
    assert '"page":"attend"' in page and '"names":["masked","weights"]' in page


def test_html_past_what_a_page_holds_is_refused_before_any_file_is_written(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = invoke(["causal", "--len", 600, "--png", "a.png", "--html", "a.html"])
    assert result.exit_code == 2 and result.stderr == (
        "maskcli: error: --html would embed 1,444,800 stage values, past the 1,048,576 a page holds: "
        "choose fewer with --batch-index/--head/--stages, or view --rows/--keys\n")
    assert list(tmp_path.iterdir()) == []


def test_at_60_columns_the_header_wraps_between_its_parts():
    """The run's header wrapped at the last space that fit, to column 0: 'device cpu · dtype float32 · scale 0.353553
    · fill:' then 'masked_fill -inf' alone, read as a line of its own; it wraps between its ' · ' parts now, two cells in."""
    result = invoke(["causal", "--len", "6"], env={"COLUMNS": "60"})
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines()[:5] == [
        "attend causal · shape (B=1, H=1, Lq=6, Lk=6, D=8)",
        "device cpu · dtype float32 · scale 0.353553 ·",
        "  fill: masked_fill -inf",
        "inputs: random, torch.Generator().manual_seed(0)",
        "cells marked × are masked",
    ]
    wide = invoke(["causal", "--len", "6"], env={"COLUMNS": "120"}).stdout.splitlines()
    assert wide[1] == "device cpu · dtype float32 · scale 0.353553 · fill: masked_fill -inf"


def test_json_past_the_values_it_prints_is_refused_before_any_stage_is_computed(monkeypatch):
    """hunt 10: attend --len 2000 --heads 64 --json computed every stage (5 GB) and then wrote some 1.5 billion values
    as JSON, for minutes; show and blocks refuse --json past JSON_MAX_VALUES, and now attend does too, up front."""
    import maskcli.attention.run as run

    def never(*args, **kwargs):
        raise AssertionError("a stage was computed")

    monkeypatch.setattr(run, "run_attention", never)
    monkeypatch.setattr("maskcli.memory.check_bytes_fit", lambda *args, **kwargs: None)  # (on a machine short of memory
    # the stages' own refusal comes first, also before any stage: this test is of --json's)
    result = CliRunner().invoke(app, ["attend", "causal", "--len", "2000", "--heads", "64", "--json"])
    assert result.exit_code == 2 and result.stdout == ""
    assert result.stderr == ("maskcli: error: --json would list 1,537,024,000 stage values, past the 4,194,304 it prints: "
                             "view a region with --rows/--keys, or use a shorter --len or fewer --heads\n")
    monkeypatch.undo()
    for args in (["--len", "835"], ["--len", "2000", "--rows", "0:100", "--keys", "0:300"]):  # at the limit; a region
        shown = CliRunner().invoke(app, ["attend", "causal", *args, "--json"])
        assert shown.exit_code == 0 and len(json.loads(shown.stdout)["stages"]["weights"][0][0]) in (835, 100), shown.stderr
