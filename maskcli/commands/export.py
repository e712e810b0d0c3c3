"""`maskcli export`: the Python call that applies a mask in a kernel's own format, and the tensors it needs."""

from __future__ import annotations

from typing import Annotated

import typer

from maskcli.commands.app import app, check_write, done, echo, make_console
from maskcli.commands.options import Expr, examples, mask_options
from maskcli.errors import MaskError
from maskcli.mask import MaskOptions

FORMAT_NAMES = "sdpa, mha, hf, flex, flash-attn, flashinfer, flashmask, magi, xformers"
SAVE_SUFFIXES = (".pt", ".safetensors", ".npz")
INLINE = 16  # tensors of at most this many values are written into the call

ForOpt = Annotated[str | None, typer.Option("--for", help=f"The library: {FORMAT_NAMES}.", show_default=False)]
ExportSave = Annotated[str | None, typer.Option("--save", metavar="FILE", help="Write the tensors the call needs: .pt (torch.load(..., weights_only=True)), .safetensors or .npz.")]
CompareOpt = Annotated[bool, typer.Option("--compare", help="Print what the mask costs in each format at its length (bytes, and whether it holds the mask exactly) instead of a call.")]


@app.command(
    epilog=examples(
        "maskcli export causal --len 4096 --for sdpa",
        "maskcli export \"document(sizes=[300,500,224]) & window(128)\" --for flash-attn",
        "maskcli export \"causal | blocks(-1,-1,0,0,0,-1)\" --for flashmask --save mask.pt",
        "maskcli export \"document(sizes=[3,5]) & window(2)\" --for magi",
        "maskcli export \"window(4096)\" --len 1048576 --compare",
    ),
)
@mask_options()
def export(
    kind: Expr = None,
    for_: ForOpt = None,
    save: ExportSave = None,
    compare: CompareOpt = False,
    *,
    mask: MaskOptions,
) -> None:
    """Print the call that applies a mask in an attention library, with its arguments filled in.

    Each format is built from the mask's exact key intervals: cu_seqlens, FlashMask column indices and Magi ranges are O(L), so a 1M-token mask takes seconds; SDPA, MHA and Hugging Face masks are dense (Lq x Lk) by nature. Where a format cannot hold the mask it says why and what would, and exits 2. --mask FILE --from FORMAT reads a format's tensors back.
    """
    from maskcli.files import check_output_path
    from maskcli.sources import registry

    if compare and (for_ is not None or save is not None):
        raise MaskError("--compare prints every format: drop --for and --save, or drop --compare")
    if not compare and for_ is None:
        raise MaskError(f"give --for LIBRARY ({FORMAT_NAMES}), or --compare")
    from maskcli.formats.registry import get

    fmt = get(for_) if for_ is not None else None
    save_path = check_output_path(save, SAVE_SUFFIXES, "--save", f"{fmt.name}_mask") if save is not None else None
    built = registry.load(kind, mask)
    if compare:
        _compare(built)
        return
    result = fmt.to(built)
    if save_path is not None:
        if not result.tensors:
            raise MaskError(f"--save: {fmt.name} needs no tensors for {built.title}; drop --save: the call it prints is all of it")
        _save(result.tensors, save_path)
    echo(render(result, built, fmt, save_path))
    if save_path is not None:
        done(f"wrote {save_path} ({', '.join(result.tensors)})")


def render(result, built, fmt, save_path) -> str:
    """The call as Python text: small tensors written inline, others read from the --save file."""
    import numpy as np

    name = fmt.name
    lines = [f"# {name}: {built.title} · shape {tuple(built.shape)}", f"# written for {fmt.version}", "import torch"]
    # a literal device is quoted; an input's (q.device) is code: the tensors go where the user's inputs are
    code_device = "." in result.device
    at = None if result.device == "cpu" else (result.device if code_device else f'"{result.device}"')
    device = "" if at is None else f", device={at}"
    big = [key for key, value in result.tensors.items() if value.size > INLINE or value.ndim > 1]
    code = "\n".join(result.code)
    if big:
        path = str(save_path) if save_path is not None else f"{name}_mask.pt"
        if save_path is None:
            lines.append(f"# the tensors: run this command again with --save {path}")
        suffix = path.rsplit(".", 1)[-1].lower()
        if suffix == "safetensors":  # load_file takes a device as a string
            lines.append(f"from safetensors.torch import load_file\nt = load_file({path!r}{'' if at is None else f', device=str({at})' if code_device else f', device={at}'})")
        elif suffix == "npz":
            lines.append(f"import numpy as np\nt = {{key: torch.from_numpy(value){'' if at is None else f'.to({at})'} for key, value in np.load({path!r}).items()}}")
        else:
            lines.append(f"t = torch.load({path!r}, weights_only=True{'' if at is None else f', map_location={at}'})")
    for key, value in result.tensors.items():
        if key in big:
            code = code.replace(f"<{key}>", f"t[{key!r}]")
        elif f"<{key}>" in code:
            dtype = {np.dtype(np.int32): "torch.int32", np.dtype(np.int64): "torch.int64", np.dtype(bool): "torch.bool"}.get(value.dtype, "torch.float32")
            lines.append(f"{key} = torch.tensor({value.tolist()}, dtype={dtype}{device})")
            code = code.replace(f"<{key}>", key)
    lines.append(code.replace("import torch\n", ""))
    lines += [f"# {note}" for note in result.notes]
    return "\n".join(lines)


def _save(tensors: dict, path) -> None:
    """Every tensor, written whole or not at all (.pt is read back with torch.load(weights_only=True))."""
    import numpy as np

    from maskcli.files import atomic_write

    arrays = {key: np.ascontiguousarray(value) for key, value in tensors.items()}
    arrays = {key: value if value.flags.writeable else value.copy() for key, value in arrays.items()}  # torch warns of read-only ones
    check_write(path, sum(a.nbytes for a in arrays.values()), "--save")
    suffix = path.suffix.lower()
    if suffix == ".npz":
        def write(temp):
            with open(temp, "wb") as handle:
                np.savez(handle, **arrays)
    elif suffix == ".safetensors":  # written here, as it is read here: no package needed for it
        from maskcli.files import write_safetensors

        def write(temp):
            write_safetensors(arrays, temp)
    else:
        import torch

        data = {key: torch.from_numpy(value) for key, value in arrays.items()}

        def write(temp):
            torch.save(data, temp)
    atomic_write(path, write)


def _compare(built) -> None:
    from rich.table import Table

    from maskcli.formats.compare import costs
    from maskcli.memory import format_bytes

    table = Table(title=f"{built.title} · shape {tuple(built.shape)}", title_justify="left")
    table.add_column("format")
    table.add_column("bytes", justify="right")
    table.add_column("holds it exactly")
    for cost in costs(built):
        table.add_row(cost.format, "-" if cost.bytes is None else format_bytes(cost.bytes), cost.exact)
    make_console(highlight=False).print(table)
