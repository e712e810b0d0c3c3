"""A .pt or .pth file (torch.save): loaded with `torch.load(weights_only=True)`, so nothing in it is run.

torch's refusal of a pickle that holds objects is mostly advice to turn weights_only off; the line kept names the
object. Its tensors come as torch.load gives them (the caller converts them at its edge): only this file type
imports torch.
"""

from __future__ import annotations

from pathlib import Path

from maskcli.errors import MaskError
from maskcli.tensorfile.base import FileType, Reading, short


def read(path: Path, where: str, reading: Reading = Reading()) -> dict:
    """Every tensor in the file by name (a lone tensor named ''), as torch.load gives them, loaded with
    weights_only=True; a dict's `reading.lists` fields kept as the lists they are, its plain ints tensors where
    `reading.numbers`."""
    import pickle
    import warnings

    import torch

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # e.g. "Detected pickle protocol 4": the error below says enough
            data = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        # torch's message is mostly advice to turn weights_only off; keep the line that names the object
        lines = [line.strip() for line in str(error).splitlines() if line.strip()]
        named = [line for line in lines if "GLOBAL" in line or line.startswith("Unsupported")]
        reason = (named or lines[1:2] or ["it holds objects other than tensors"])[0]
        raise MaskError(
            f"{where}: refused to load with weights_only=True, nothing in it was run ({reason[:200]}); "
            "save the tensor itself with torch.save(tensor, path)"
        ) from None
    except Exception as error:  # torch raises RuntimeError, EOFError, zipfile errors... for bad files
        raise MaskError(f"{where}: not a readable .pt file ({_first_sentence(error)}): save it again with "
                        f"torch.save(tensor, path), or give the file the .pt really is") from None
    for name, value in (data.items() if isinstance(data, dict) else [("", data)]):
        if isinstance(value, torch.Tensor) and value.is_nested:  # its sizes are per item: every reader would fail on it
            label = f" entry {name!r}" if name else ""
            raise MaskError(f"{where}{label} is a nested tensor (items of different shapes); save a plain tensor "
                            f"(torch.nested.to_padded_tensor, or each item alone)")
    if isinstance(data, torch.Tensor):
        return {"": data}
    kept = {name: data.pop(name) for name in reading.lists if isinstance(data, dict) and name in data}
    if kept and not data:
        raise MaskError(f"{where}: holds only {', '.join(kept)}, no tensors")
    if reading.numbers and isinstance(data, dict):
        data = {k: _as_tensor(v) for k, v in data.items()}
    if isinstance(data, dict) and data and all(isinstance(v, torch.Tensor) for v in data.values()):
        return {str(k): v for k, v in data.items()} | kept
    if isinstance(data, dict) and data.get("format") == "maskcli-trace-1":  # (tracefile.FORMAT) read whole, as a tensor
        calls = data.get("calls")
        count = f" ({len(calls):,} call{'s' if len(calls) != 1 else ''})" if isinstance(calls, list) else ""
        raise MaskError(f"{where} is a maskcli trace file{count}, not a tensor file: where a mask is read, name one call "
                        "of it, FILE:0 or FILE:PATH@STEP (as trace's report numbers them)")
    if isinstance(data, dict) and data:
        odd = next(k for k, v in data.items() if not isinstance(v, torch.Tensor))
        raise MaskError(f"{where}: entry {odd!r} of the dict is {type(data[odd]).__name__} {short(data[odd])}, not a tensor; save only tensors")
    raise MaskError(f"{where}: holds {type(data).__name__} {short(data)}, not a tensor or a dict of tensors")


def _as_tensor(value):
    """A plain int or a (nested) list of ints as a tensor; anything else as it is."""
    import torch

    if isinstance(value, bool) or not isinstance(value, (int, list)):
        return value
    try:
        return torch.tensor(value, dtype=torch.int64)
    except (TypeError, ValueError, RuntimeError, OverflowError):
        return value


FILE_TYPE = FileType("pt", (".pt", ".pth"), read)


def _first_sentence(error: BaseException) -> str:
    """The error's type and its first sentence (torch's zip errors go on with advice that is not for this file: "This
    is an internal miniz error. If you are seeing this error, there is a high..."), never cut mid-word."""
    text = " ".join(str(error).split())
    first = text.split(". ")[0].rstrip(".")
    if len(first) > 160:
        first = first[:160].rsplit(" ", 1)[0] + " ..."
    return f"{type(error).__name__}: {first}" if first else type(error).__name__
