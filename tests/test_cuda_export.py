"""export's printed calls on a CUDA device, through the GPU kernels themselves: FlexAttention compiled to Triton with the
BlockMask `export --for flex --save` wrote (and `blocks --save`), and SDPA's flash, memory-efficient and cuDNN
backends with the mask or flags `export --for sdpa` prints. The reference is a mask written by broadcasting over
absolute positions and SDPA's math backend on the same device.

Every test here is marked `cuda` and skipped where torch sees no CUDA device (`pytest -m cuda`).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from typer.testing import CliRunner

from maskcli.commands import app

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

runner = CliRunner()

# (flags, keep(q, kv) on absolute position tensors, query positions, key positions); lengths past one 128-block so
# that the BlockMask has full, partial and empty blocks
CASES = [
    (["causal", "--len", 700], lambda q, kv: kv <= q, (0, 700), (0, 700)),
    (["window(100)", "--len", 600], lambda q, kv: (kv <= q) & (kv > q - 100), (0, 600), (0, 600)),
    (["document(sizes=[200,300,100])"], lambda q, kv: ((q >= 200).int() + (q >= 500).int() == (kv >= 200).int() + (kv >= 500).int()) & (kv <= q),
     (0, 600), (0, 600)),
    (["causal", "--len", 130, "--offset", 400], lambda q, kv: kv <= q, (400, 530), (0, 530)),
    (["prefix", "--prefix", 150, "--len", 400], lambda q, kv: (kv <= q) | (kv < 150), (0, 400), (0, 400)),
    (["local(128)", "--len", 500], lambda q, kv: (q // 128 == kv // 128) & (kv <= q), (0, 500), (0, 500)),
]


def dense(keep, q_range, k_range, device) -> torch.Tensor:
    q = torch.arange(*q_range, device=device)[:, None]
    kv = torch.arange(*k_range, device=device)[None, :]
    return keep(q, kv)


def exported(tmp_path, flags, fmt) -> str:
    path = tmp_path / f"{fmt}.pt"
    result = runner.invoke(app, ["export", *map(str, flags), "--for", fmt, "--save", str(path)])
    if result.exit_code == 2 and "needs no tensors" in result.stderr:
        result = runner.invoke(app, ["export", *map(str, flags), "--for", fmt])
    assert result.exit_code == 0, result.output
    return result.stdout.replace(f"'{fmt}_mask.pt'", repr(str(path)))


def inputs(lq, lk, dtype=torch.float16):
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(2, 4, lq, 64, device="cuda", dtype=dtype, generator=g)
    k, v = (torch.randn(2, 4, lk, 64, device="cuda", dtype=dtype, generator=g) for _ in range(2))
    return q, k, v


def reference(q, k, v, keep):
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=keep).to(q.dtype)


def run_printed(code, scope, cwd):
    import os

    here = os.getcwd()
    os.chdir(cwd)
    try:
        exec(code, scope)
    finally:
        os.chdir(here)
    return scope["out"]


@pytest.mark.parametrize("flags, keep, q_range, k_range", CASES, ids=[" ".join(map(str, c[0])) for c in CASES])
def test_the_printed_flex_call_runs_compiled_on_cuda(tmp_path, flags, keep, q_range, k_range):
    """`export --for flex` as printed, with flex_attention compiled (the Triton kernel that skips empty blocks and
    calls mask_mod only on partial ones): a wrong BlockMask or a mask_mod dynamo cannot trace fails here, not on cpu."""
    from torch.nn.attention import flex_attention as module

    want = dense(keep, q_range, k_range, "cuda")
    q, k, v = inputs(want.shape[0], want.shape[1])
    compiled = torch.compile(module.flex_attention, dynamic=False)
    code = exported(tmp_path, flags, "flex").replace("out = flex_attention(", "out = compiled(")
    out = run_printed(code, {"q": q, "k": k, "v": v, "compiled": compiled}, tmp_path)
    assert out.device.type == "cuda"
    assert (out.float() - reference(q, k, v, want).float()).abs().max().item() < 2e-2


@pytest.mark.parametrize("flags, keep, q_range, k_range", CASES, ids=[" ".join(map(str, c[0])) for c in CASES])
def test_blocks_save_is_create_block_mask_on_cuda(tmp_path, flags, keep, q_range, k_range):
    """`blocks --save` rebuilds the BlockMask create_block_mask makes on the GPU, tensor for tensor (flags that only
    export reads are left out)."""
    from torch.nn.attention.flex_attention import create_block_mask

    path = tmp_path / "blocks.pt"
    result = runner.invoke(app, ["blocks", *map(str, flags), "--save", str(path)])
    assert result.exit_code == 0, result.output
    saved = torch.load(path, weights_only=True)
    q0, k0 = q_range[0], k_range[0]

    def mask_mod(b, h, q_idx, kv_idx):
        return keep(q_idx + q0, kv_idx + k0)

    made = create_block_mask(mask_mod, None, None, q_range[1] - q0, k_range[1] - k0, device="cuda")
    for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"):
        ours, theirs = saved[name], getattr(made, name).cpu()
        counts = saved["kv_num_blocks" if not name.startswith("full") else "full_kv_num_blocks"]
        if name.endswith("indices"):  # past each row's count the index tensor is padding, whatever it holds
            n = counts[..., :, None] > torch.arange(ours.shape[-1])
            assert torch.equal(ours[n], theirs[..., : ours.shape[-1]][n]), name
        else:
            assert torch.equal(ours.reshape(-1), theirs.reshape(-1)), name


BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]
SDPA = [c for c in CASES if c[0][0] in ("causal", "window(100)", "prefix")]


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.name)
@pytest.mark.parametrize("flags, keep, q_range, k_range", SDPA, ids=[" ".join(map(str, c[0])) for c in SDPA])
def test_the_printed_sdpa_call_on_each_gpu_backend(tmp_path, backend, flags, keep, q_range, k_range):
    """`export --for sdpa` as printed, under each fused backend that accepts it (flash takes no attn_mask, and
    is_causal only square-or-bottom-right... it refuses what it cannot run, which skips; it never runs a wrong mask)."""
    want = dense(keep, q_range, k_range, "cuda")
    q, k, v = inputs(want.shape[0], want.shape[1])
    code = exported(tmp_path, flags, "sdpa")
    try:
        with sdpa_kernel(backend):
            out = run_printed(code, {"q": q, "k": k, "v": v}, tmp_path)
    except RuntimeError as error:
        if "No available kernel" in str(error):
            pytest.skip(f"{backend.name} does not take this call: {str(error).splitlines()[0]}")
        raise
    assert (out.float() - reference(q, k, v, want).float()).abs().max().item() < 2e-2
