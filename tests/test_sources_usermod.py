"""sources/usermod.py, --mask-mod: a user's FlexAttention mask_mod, run only behind that flag, checked, and usable in
expressions."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch.nn.attention.flex_attention import create_mask

from maskcli.errors import MaskError
from maskcli.mask import MaskOptions, build
from maskcli.sources import registry, usermod
from maskcli.sources.usermod import load_function, looks_like_spec

GYM = str(Path(__file__).parent / "data" / "gym_masks.py")


def spec(name: str) -> str:
    return f"{GYM}:{name}"


def reference(mod, q_len, k_len):
    return create_mask(mod, 1, 1, q_len, k_len, device="cpu")[0, 0].numpy()


@pytest.mark.parametrize("name, args, expression, length", [
    ("causal_mask", None, "causal", 7),
    ("generate_sliding_window", "2", "window(3)", 9),  # attention-gym's window w is maskcli's window(w + 1)
    ("generate_prefix_lm_mask", "2", "prefix(3)", 8),
    ("packed_causal", None, "document(sizes=[3,5])", 8),
    ("scalar_branches", None, "causal", 5),
])
def test_gym_mask_mods_equal_create_mask_and_the_expression_that_means_them(name, args, expression, length):
    _, function, _ = load_function(spec(name), args)
    built = registry.load(None, MaskOptions(length=length, mask_mod=spec(name), mask_mod_args=args))
    assert not built.exact and "counted cell by cell" in built.why_not_exact
    assert np.array_equal(built.dense()[0, 0], reference(function, length, length))
    assert np.array_equal(built.dense(), build(expression, length=length).dense())


def test_the_name_stands_in_expressions_and_gets_local_indices_behind_an_offset():
    options = MaskOptions(length=4, offset=3, mask_mod=spec("causal_mask"))
    both = registry.load("causal_mask & ~tril(-1)", options)
    assert both.text == "causal_mask & ~tril(-1)"
    _, function, _ = load_function(spec("causal_mask"))
    local = reference(function, 4, 7)  # what FlexAttention gives the same mask_mod on these sizes
    expected = local & ~build("tril(-1)", length=4, offset=3).dense()[0, 0]
    assert np.array_equal(both.dense()[0, 0], expected)


def test_a_module_path_loads_too(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(GYM).parent))
    name, function, _ = load_function("gym_masks:causal_mask")
    assert name == "causal_mask" and looks_like_spec("gym_masks:causal_mask") and looks_like_spec("a/b.py:f")
    assert not looks_like_spec("causal & window(3)") and not looks_like_spec("mask.pt")


@pytest.mark.parametrize("name, args, says", [
    ("raises", None, "your mask_mod raises raised ValueError: a bug in my mask (gym_masks.py line"),
    ("returns_floats", None, "returned float32 values; a mask_mod returns bool"),
    ("returns_a_row", None, "returned shape [3] for indices of shape [1, 1, 5, 5]"),
    ("returns_a_number", None, "returned a int; a mask_mod returns a bool tensor"),
    ("needs_three", None, "needs_three takes 3 arguments, not a mask_mod's four"),
    ("generate_sliding_window", None, "takes 1 argument, not a mask_mod's four (b, h, q_idx, kv_idx): if it makes one, give its arguments with --mask-mod-args"),
    ("generate_sliding_window", "1, 2", "failed: TypeError"),
    ("generate_sliding_window", "import os", "is not Python literals separated by commas"),
    ("nothing_here", None, "has no 'nothing_here'"),
])
def test_bad_mask_mods_are_one_line_naming_what_is_wrong(name, args, says):
    with pytest.raises(MaskError) as error:
        registry.load(None, MaskOptions(length=5, mask_mod=spec(name), mask_mod_args=args)).dense()
    assert says in str(error.value) and "\n" not in str(error.value)


def test_refusals_around_the_flags(tmp_path):
    with pytest.raises(MaskError, match="no such file"):
        load_function(f"{tmp_path}/missing.py:f")
    with pytest.raises(MaskError, match="is the name of a maskcli kind"):
        (tmp_path / "kinds.py").write_text("def causal(b, h, q, kv):\n    return q >= kv\n")
        usermod.kinds(f"{tmp_path}/kinds.py:causal", None)
    with pytest.raises(MaskError, match="--mask-mod-args is for --mask-mod"):
        usermod.kinds(None, "4")
    (tmp_path / "broken.py").write_text("import torch\nraise RuntimeError('at import')\n")
    with pytest.raises(MaskError, match=r"loading .*broken.py failed: RuntimeError: at import \(broken.py line 2\)"):
        load_function(f"{tmp_path}/broken.py:f")


def test_user_code_runs_only_behind_the_flag(tmp_path):
    marker = tmp_path / "ran"
    (tmp_path / "side.py").write_text(f"open({str(marker)!r}, 'w').write('x')\ndef m(b, h, q, kv):\n    return q >= kv\n")
    with pytest.raises(MaskError):
        registry.load(f"{tmp_path}/side.py:m", MaskOptions(length=3))  # as an expression, it is not loaded
    assert not marker.exists()
    registry.load(None, MaskOptions(length=3, mask_mod=f"{tmp_path}/side.py:m"))
    assert marker.exists()


def test_a_mask_mods_print_goes_to_stderr_and_leaves_json_whole(tmp_path, monkeypatch):
    import json
    import subprocess
    import sys

    (tmp_path / "noisy.py").write_text(
        "print('loading')\n"
        "def noisy(b, h, q, kv):\n    print('called')\n    return kv <= q\n\n"
        "def factory(w):\n    print('factory', w)\n    return lambda b, h, q, kv: (q - kv < w) & (kv <= q)\n"
    )
    for command, args, said in (
        (["show"], ["--mask-mod", "noisy.py:noisy"], "called"),
        (["blocks", "--block", "2"], ["--mask-mod", "noisy.py:factory", "--mask-mod-args", "2"], "factory 2"),
    ):
        done = subprocess.run(
            [sys.executable, "-m", "maskcli", *command, *args, "--len", "3", "--json"],
            cwd=tmp_path, capture_output=True, text=True, timeout=120,
        )
        assert done.returncode == 0, done.stderr
        json.loads(done.stdout)  # stdout is the object alone
        assert "loading" in done.stderr and said in done.stderr


def test_the_registry_knows_the_usermod_source_and_it_stands_alone():
    assert registry.sources()["usermod"].load is usermod.load
    options = MaskOptions(length=6, mask_mod=spec("generate_sliding_window"), mask_mod_args="2")
    alone = usermod.load(spec("generate_sliding_window"), options)
    window = lambda b, h, q, kv: (q >= kv) & (q - kv <= 2)  # attention-gym's sliding window, written out
    assert np.array_equal(alone.dense()[0, 0], reference(window, 6, 6))

