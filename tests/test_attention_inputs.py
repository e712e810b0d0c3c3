"""maskcli.attention.inputs: devices, dtypes, q, k, v and x from each file type and shape, projection, checks (each file
type's own reading is tested in tests/test_tensorfile_*.py)."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
import torch

from maskcli.errors import MaskError
from maskcli.attention.inputs import (
    QKV,
    as_4d,
    available_devices,
    check_against_mask,
    load_given,
    make_qkv,
    project,
    resolve_device,
    resolve_dtype,
)
from maskcli.tensorfile import load_tensor

TUTORIAL_X = [
    [0.43, 0.15, 0.89],
    [0.55, 0.87, 0.66],
    [0.57, 0.85, 0.64],
    [0.22, 0.58, 0.33],
    [0.77, 0.25, 0.10],
    [0.05, 0.80, 0.55],
]


def write_safetensors(path, tensors, dtype="F32"):
    """The format by hand: 8-byte little-endian header length, a JSON header, raw little-endian bytes."""
    numpy_dtype = {"F32": "<f4", "F64": "<f8", "F16": "<f2", "I64": "<i8"}[dtype]
    header, blobs, offset = {"__metadata__": {"format": "pt"}}, [], 0
    for name, tensor in tensors.items():
        raw = np.asarray(tensor.tolist(), dtype=numpy_dtype).tobytes()
        header[name] = {"dtype": dtype, "shape": list(tensor.shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def write(path, fmt, tensor, name="q"):
    if fmt == "pt":
        torch.save(tensor, path)
    elif fmt == "pt-dict":
        torch.save({name: tensor, "other": torch.zeros(1)}, path)
    elif fmt == "npy":
        np.save(path, tensor.numpy())
    elif fmt == "npz":
        np.savez(path, **{name: tensor.numpy()})
    elif fmt == "safetensors":
        write_safetensors(path, {name: tensor})
    elif fmt == "json":
        path.write_text(json.dumps(tensor.tolist()))
    elif fmt == "json-dict":
        path.write_text(json.dumps({name: tensor.tolist()}))
    else:
        raise ValueError(fmt)
    return str(path)


SUFFIX = {"pt": "pt", "pt-dict": "pt", "npy": "npy", "npz": "npz", "safetensors": "safetensors", "json": "json", "json-dict": "json"}


@pytest.mark.parametrize("fmt", list(SUFFIX) + ["inline"])
@pytest.mark.parametrize("shape", [(4, 3), (2, 4, 3), (2, 3, 4, 3)])
def test_each_format_and_shape_loads_the_same_numbers(tmp_path, fmt, shape):
    tensor = torch.arange(np.prod(shape), dtype=torch.float32).reshape(shape) / 7 - 1
    source = json.dumps(tensor.tolist()) if fmt == "inline" else write(tmp_path / f"t.{SUFFIX[fmt]}", fmt, tensor)
    loaded = load_tensor(source, "--q", ("q",))
    assert loaded.shape == shape
    assert torch.allclose(loaded.float(), tensor, atol=1e-6)
    four = as_4d(loaded, "--q")
    assert four.dim() == 4 and four.shape[-2:] == (4, 3)
    expected_lead = {2: (1, 1), 3: (shape[0], 1), 4: shape[:2]}[len(shape)]
    assert four.shape[:2] == expected_lead


def test_load_given_takes_q_k_v_in_that_order_and_each_file_by_its_name(tmp_path):
    q, k, v = (torch.full((3, 2), float(i)) for i in range(3))
    sources = [write(tmp_path / f"{n}.safetensors", "safetensors", t, n) for n, t in zip("qkv", (q, k, v))]
    given = load_given(*sources, None)
    assert given.x is None
    for got, want in zip((given.q, given.k, given.v), (q, k, v)):
        assert torch.equal(got, want[None, None])
    # one file holding all three, each picked by its name
    both = tmp_path / "all.safetensors"
    write_safetensors(both, {"v": v, "k": k, "q": q})
    given = load_given(str(both), str(both), str(both), None)
    assert [given.q[0, 0, 0, 0].item(), given.k[0, 0, 0, 0].item(), given.v[0, 0, 0, 0].item()] == [0.0, 1.0, 2.0]


def test_q_k_v_take_precedence_over_x_and_x_alone_is_kept_unprojected():
    inline = json.dumps([[1.0, 2.0], [3.0, 4.0]])
    given = load_given(inline, inline, inline, json.dumps(TUTORIAL_X))
    assert given.x is None and given.q.shape == (1, 1, 2, 2)
    given = load_given(None, None, None, json.dumps(TUTORIAL_X))
    assert given.q is None and torch.equal(given.x, torch.tensor(TUTORIAL_X, dtype=torch.float64))
    assert load_given(None, None, None, None) is None


def test_integer_and_bool_inputs_become_float32_and_json_floats_float64():
    assert load_tensor("[[1, 2], [3, 4]]", "--q").dtype == torch.int64
    given = load_given("[[1, 2], [3, 4]]", "[[1, 0], [0, 1]]", "[[true, false], [false, true]]", None)
    assert given.q.dtype == given.k.dtype == given.v.dtype == torch.float32
    assert given.v.flatten().tolist() == [1.0, 0.0, 0.0, 1.0]
    given = load_given(None, None, None, "[[1.5, 2.5]]")
    assert given.x.dtype == torch.float64  # JSON numbers are doubles: kept so until the compute dtype


# --- bad inputs: one MaskError each, nothing run --------------------------------------------


def test_a_file_holding_one_tensor_is_that_input_unless_it_is_named_for_another(tmp_path):
    hidden = torch.arange(6.0).view(3, 2)
    write_safetensors(tmp_path / "hidden.safetensors", {"hidden_states": hidden})
    np.savez(tmp_path / "default.npz", hidden.numpy())  # numpy names it arr_0
    for path in (tmp_path / "hidden.safetensors", tmp_path / "default.npz"):
        assert torch.equal(load_given(None, None, None, str(path)).x, hidden), path
    torch.save({"k": hidden}, tmp_path / "keys.pt")
    with pytest.raises(MaskError, match="holds only 'k', another input's name; expected 'x': save it under that name"):
        load_given(None, None, None, str(tmp_path / "keys.pt"))
    torch.save({"q": hidden, "n": 3}, tmp_path / "mixed.pt")
    with pytest.raises(MaskError, match="entry 'n' of the dict is int 3, not a tensor; save only tensors"):
        load_given(str(tmp_path / "mixed.pt"), "[[1]]", "[[1]]", None)


def test_empty_tensor_and_complex_tensor_are_refused(tmp_path):
    with pytest.raises(MaskError, match="empty"):
        load_given("[]", "[]", "[]", None)
    path = tmp_path / "c.pt"
    torch.save(torch.ones(2, 2, dtype=torch.complex64), path)
    with pytest.raises(MaskError, match="complex64; give real numbers"):
        load_given(str(path), str(path), str(path), None)


def test_only_some_of_q_k_v_is_refused():
    with pytest.raises(MaskError, match=r"missing --k, --v"):
        load_given("[[1.0]]", None, None, None)
    with pytest.raises(MaskError, match=r"missing --q\b"):
        load_given(None, "[[1.0]]", "[[1.0]]", None)


@pytest.mark.parametrize("shape", [(3,), (1, 1, 1, 4, 3)])
def test_shapes_other_than_2_3_4_dimensions_are_refused(shape):
    tensor = torch.zeros(shape)
    with pytest.raises(MaskError, match=r"--v has shape \[" + ", ".join(map(str, shape)) + r"\]: expected \[L, D\], \[B, L, D\] or \[B, H, L, D\]"):
        as_4d(tensor, "--v")
    with pytest.raises(MaskError, match="expected"):
        load_given(json.dumps(tensor.tolist()), "[[1.0]]", "[[1.0]]", None)
    with pytest.raises(MaskError, match=r"--x has shape"):
        load_given(None, None, None, json.dumps(torch.zeros(2, 2, 2, 2).tolist()))


# --- devices and dtypes ---------------------------------------------------------------------


def test_cpu_and_auto_resolve_here():
    assert resolve_device("cpu") == torch.device("cpu")
    expected = "cuda" if torch.cuda.is_available() else "mps" if "mps" in available_devices() else "cpu"
    assert resolve_device("auto").type == expected
    assert available_devices()[0] == "cpu"


def test_unknown_device_lists_what_is_available():
    with pytest.raises(MaskError, match=r"unknown --device 'tpu'.*cpu") as error:
        resolve_device("tpu")
    assert "cpu" in str(error.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="cuda is present here")
@pytest.mark.parametrize("name", ["cuda", "cuda:0", "cuda:3"])
def test_unavailable_cuda_is_an_error_listing_available_devices(name):
    with pytest.raises(MaskError, match=rf"--device '{name}' is not available here; available: cpu"):
        resolve_device(name)


def test_dtypes():
    assert resolve_dtype("float32") is torch.float32
    assert resolve_dtype("float16") is torch.float16
    assert resolve_dtype("bfloat16") is torch.bfloat16
    assert resolve_dtype("float64") is torch.float64
    for bad in ("float8", "int32", "fp16", ""):
        with pytest.raises(MaskError, match="unknown --dtype .*float32, float16, bfloat16, float64"):
            resolve_dtype(bad)


# --- projection and random inputs -----------------------------------------------------------


def test_projection_is_three_seeded_linears_in_query_key_value_order():
    x = torch.tensor(TUTORIAL_X)
    q, k, v = project(x, seed=789, d_out=2, heads=1, bias=False)
    torch.manual_seed(789)
    w_query, w_key, w_value = (torch.nn.Linear(3, 2, bias=False) for _ in range(3))
    with torch.no_grad():
        assert torch.equal(q[0, 0], w_query(x))
        assert torch.equal(k[0, 0], w_key(x))
        assert torch.equal(v[0, 0], w_value(x))
    # with bias the layers draw their biases too; with heads, d_out splits into (H, d_out / H)
    q2, _, _ = project(x[None].repeat(2, 1, 1), seed=1, d_out=4, heads=2, bias=True)
    torch.manual_seed(1)
    layer = torch.nn.Linear(3, 4, bias=True)
    with torch.no_grad():
        expected = layer(x)
    assert q2.shape == (2, 2, 6, 2)
    assert torch.allclose(q2[1, 1], expected[:, 2:]) and torch.allclose(q2[0, 0], expected[:, :2])
    with pytest.raises(MaskError, match="--d-out 3 does not split into --heads 2"):
        project(x, seed=0, d_out=None, heads=2, bias=False)


def test_x_gives_queries_from_its_last_rows_for_prefill():
    given = load_given(None, None, None, json.dumps(TUTORIAL_X))
    qkv = make_qkv(given, seed=789, batch=1, heads=1, head_dim=8, d_out=2, qkv_bias=False, q_len=2, k_len=6)
    full_q, full_k, full_v = project(torch.tensor(TUTORIAL_X), seed=789, d_out=2, heads=1, bias=False)
    assert torch.equal(qkv.q, full_q[:, :, 4:]) and torch.equal(qkv.k, full_k) and torch.equal(qkv.v, full_v)
    assert "789" in qkv.source


@pytest.mark.parametrize("q_len, k_len", [(5, 6), (3, 3), (1, 4)])
def test_x_with_a_row_count_other_than_the_keys_is_named_as_x(q_len, k_len):
    given = load_given(None, None, None, json.dumps(TUTORIAL_X[:5]))
    with pytest.raises(MaskError, match=rf"--x has 5 rows \(dim -2, one per token\) but the mask has {k_len} key positions"):
        make_qkv(given, seed=0, batch=1, heads=1, head_dim=8, d_out=None, qkv_bias=False, q_len=q_len, k_len=k_len)


def test_random_inputs_follow_the_seed_and_sizes():
    a = make_qkv(None, seed=3, batch=2, heads=3, head_dim=5, d_out=None, qkv_bias=False, q_len=4, k_len=6)
    b = make_qkv(None, seed=3, batch=2, heads=3, head_dim=5, d_out=None, qkv_bias=False, q_len=4, k_len=6)
    c = make_qkv(None, seed=4, batch=2, heads=3, head_dim=5, d_out=None, qkv_bias=False, q_len=4, k_len=6)
    assert a.q.shape == (2, 3, 4, 5) and a.k.shape == a.v.shape == (2, 3, 6, 5)
    assert torch.equal(a.q, b.q) and torch.equal(a.v, b.v) and not torch.equal(a.q, c.q)
    generator = torch.Generator().manual_seed(3)
    assert torch.equal(a.q, torch.randn(2, 3, 4, 5, generator=generator))
    with pytest.raises(MaskError, match="--head-dim and --batch must be at least 1"):
        make_qkv(None, seed=0, batch=1, heads=1, head_dim=0, d_out=None, qkv_bias=False, q_len=2, k_len=2)


# --- inputs against the mask ----------------------------------------------------------------


def qkv(q_shape, k_shape, v_shape=None):
    return QKV(torch.zeros(q_shape), torch.zeros(k_shape), torch.zeros(v_shape or k_shape), "test")


@pytest.mark.parametrize(
    "shapes, mask, message",
    [
        (((1, 1, 3, 4), (1, 1, 5, 4)), (1, 1, 4, 5), r"query length \(dim -2 of q\) is 3 but the mask has 4"),
        (((1, 1, 4, 4), (1, 1, 6, 4)), (1, 1, 4, 5), r"key length \(dim -2 of k\) is 6 but the mask has 5"),
        (((1, 1, 4, 4), (1, 1, 5, 4), (1, 1, 3, 4)), (1, 1, 4, 5), r"value length \(dim -2 of v\) is 3 but the mask has 5"),
        (((1, 1, 4, 4), (1, 1, 5, 3)), (1, 1, 4, 5), r"head sizes differ \(4 vs 3, dim -1\)"),
        (((3, 1, 4, 4), (3, 1, 5, 4)), (2, 1, 4, 5), r"batch \(dim 0\) does not agree: q 3, k/v 3, mask 2"),
        (((1, 2, 4, 4), (1, 3, 5, 4)), (1, 1, 4, 5), r"heads \(dim 1\) does not agree"),
        (((1, 1, 4, 4), (2, 1, 5, 4), (1, 1, 5, 4)), (1, 1, 4, 5), r"k and v batch/heads differ"),
    ],
)
def test_inputs_that_disagree_with_the_mask_name_the_dimension(shapes, mask, message):
    with pytest.raises(MaskError, match=message):
        check_against_mask(qkv(*shapes), mask)


def test_inputs_broadcast_against_the_mask_batch_and_heads():
    q = torch.randn(1, 1, 4, 3)
    k = torch.randn(1, 2, 5, 3)
    out = check_against_mask(QKV(q, k, k.clone(), "test"), (3, 1, 4, 5))
    assert out.q.shape == (3, 2, 4, 3) and out.k.shape == out.v.shape == (3, 2, 5, 3)
    assert torch.equal(out.q[2, 1], q[0, 0]) and torch.equal(out.k[1, 1], k[0, 1])
