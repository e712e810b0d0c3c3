"""`maskcli verify`: one mask and one Q/K/V through every PyTorch attention kernel, compared."""

from __future__ import annotations

from typing import Annotated

import typer

from maskcli.commands.app import app, echo, make_console
from maskcli.commands.inputs import InputOptions, mask_and_inputs
from maskcli.commands.options import Expr, Atol, Repeat, Strict, VerifyJson, examples, input_options, mask_options
from maskcli.errors import MaskError
from maskcli.mask import MaskOptions


@app.command(
    epilog=examples(
        "maskcli verify causal --len 16",
        "maskcli verify \"document(0,0,1,1,1) & window(2)\"",
        "maskcli verify padding --lengths 5,0 --device cuda --dtype float16",
        "maskcli verify prefill --offset 4 --len 2 --strict --json",
    ),
)
@mask_options(heads=2, tokens=False)
@input_options(head_dim=16)
def verify(
    kind: Expr = None,
    atol: Atol = None,
    repeat: Repeat = 5,
    strict: Strict = False,
    json_: VerifyJson = False,
    *,
    mask: MaskOptions,
    inputs: InputOptions,
) -> None:
    """Run one mask and one Q/K/V through every PyTorch attention kernel and compare them.

    Backends: maskcli's staged computation; F.scaled_dot_product_attention under each backend (math, flash, efficient, cudnn; one that refuses says why); nn.MultiheadAttention (block-convention attn_mask and key_padding_mask, identity projections); flex_attention with the mask's own predicate. Each is compared with a float64 reference on rows that see a key; for fully masked rows the table says what each backend returned (zero, NaN, the unmasked row, the mean of V, other).
    """
    if atol is not None and not 0 <= atol < float("inf"):  # inf would pass every kernel, whatever it computes
        raise MaskError(f"--atol must be 0 or more and finite, got {atol}")
    if not 1 <= repeat <= 1000:
        raise MaskError(f"--repeat must be 1 to 1000, got {repeat}")
    built, qkv, torch_device, torch_dtype = mask_and_inputs(kind, mask, inputs)
    from maskcli.attention import verify as verify_core
    from maskcli.attention.inputs import check_against_mask

    _finite(qkv)
    qkv = check_against_mask(qkv, built.shape)
    tensors = [t.to(device=torch_device, dtype=torch_dtype).contiguous() for t in (qkv.q, qkv.k, qkv.v)]
    tolerance = verify_core.DEFAULT_ATOL[torch_dtype] if atol is None else atol
    results = verify_core.verify(built, *tensors, scale=inputs.scale, atol=tolerance, repeat=repeat)
    dtype_name = str(torch_dtype).removeprefix("torch.")
    if json_:
        echo(verify_core.results_json(results, built, tensors[0], tolerance))
    else:

        from maskcli.attention.findings import mask_findings
        from maskcli.render.backends import backends_table

        empty = [f.message for f in mask_findings(built.materialize(torch_device), built) if f.code == "fully-masked"]
        where = "" if built.frame.is_plain() else f" · {built.frame.describe()}"
        title = (
            f"verify {built.title} · shape (B={tensors[0].shape[0]}, H={tensors[0].shape[1]}, Lq={built.frame.q_len}, "
            f"Lk={built.frame.k_len}, D={tensors[0].shape[-1]}){where} · {torch_device} {dtype_name} · inputs: {qkv.source}\n"
            + ("\n".join(empty) if empty else "every query row sees at least one key")
        )
        from maskcli.render import labelled

        console = make_console()

        for line in title.split("\n"):  # at the terminal's width (the table is only as wide as its columns), never to column 0
            console.print(labelled(line))
        console.print(backends_table(results, tolerance))
    if strict and not all(r.agrees(tolerance) for r in results):
        raise typer.Exit(1)


def _finite(qkv) -> None:
    """Refuse NaN or inf in the inputs: the float64 reference is NaN there too, so every backend read "DISAGREES, nan"
    while each computed what the reference did (attend shows where NaN and inf go)."""
    import torch

    for name, tensor in zip("qkv", (qkv.q, qkv.k, qkv.v)):
        bad = ~torch.isfinite(tensor)
        if bool(bad.any()):
            given = "--x, projected," if qkv.source.startswith("--x") else f"--{name}"
            raise MaskError(f"{given} holds {tensor[bad][0].item()} ({int(bad.sum()):,} of {tensor.numel():,} values): verify "
                            "compares kernels with a reference, and NaN or inf in the inputs makes every output NaN: give "
                            "finite inputs (maskcli attend shows what NaN and inf do stage by stage)")
