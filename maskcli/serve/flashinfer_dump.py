"""FlashInfer's own API-logging dump of a plan() call (FLASHINFER_LOGLEVEL=10), read as it is on disk.

flashinfer/api_logging.py writes one folder per call: inputs.pt (torch.save) or inputs.safetensors
with each tensor argument under `arg_{i}` (positional) or `kwarg_{name}`, and metadata.jsonl whose
last record holds `function_name`, `function_signature` (the parameters' names, in order) and
`input_metadata` (the other arguments' values under the same keys). The names come from the
signature, so BatchPrefillWithPagedKVCacheWrapper.plan, the ragged wrapper's and
BatchDecodeWithPagedKVCacheWrapper.plan (indptr, indices, last_page_len: one query per request)
read as FlashInfer's plan() arguments.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from maskcli.errors import MaskError

DECODE_NAMES = {"indptr": "paged_kv_indptr", "indices": "paged_kv_indices", "last_page_len": "paged_kv_last_page_len"}


def is_dump(source: str) -> bool:
    return Path(source).is_dir()


def parameters(signature: str) -> list[str]:
    """The parameter names of a signature's text, "(self, a: int, b: Optional[Dict[str, int]] = None)"."""
    text, depth, parts, current = signature.strip(), 0, [], ""
    text = text[1:text.rindex(")")] if text.startswith("(") and ")" in text else text
    for char in text:
        depth += char in "([{"
        depth -= char in ")]}"
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    parts.append(current)
    names = [part.split(":")[0].split("=")[0].strip().lstrip("*") for part in parts]
    return [name for name in names if name and name != "/"]


def _record(folder: Path) -> dict:
    path = folder / "metadata.jsonl"
    if not path.is_file():
        raise MaskError(f"{str(folder)!r} is a folder without metadata.jsonl: give a FlashInfer API-logging call folder "
                        f"(FLASHINFER_LOGLEVEL=10 writes one per call) or a file of named tensors")
    lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    try:
        record = json.loads(lines[-1])
    except (IndexError, ValueError, RecursionError) as error:
        raise MaskError(f"{str(path)!r}: its last line is not a JSON record ({' '.join(str(error).split())[:120]})") from None
    if not isinstance(record, dict):
        raise MaskError(f"{str(path)!r}: its last line is a JSON {type(record).__name__}, not the record of a call "
                        f"(an object with function_name, function_signature and input_metadata)")
    for key, kind in (("function_name", str), ("function_signature", str), ("input_metadata", dict)):
        if record.get(key) is not None and not isinstance(record[key], kind):
            raise MaskError(f"{str(path)!r}: {key} is a JSON {type(record[key]).__name__} ({str(record[key])[:40]!r}); "
                            f"FlashInfer writes a {'string' if kind is str else 'object'} there")
    return record


def read_dump(source: str) -> dict:
    """The plan() call's arguments by their parameter names: tensors as saved, other values from the metadata."""
    from maskcli.tensorfile import read_tensors

    folder = Path(source)
    record = _record(folder)
    function = str(record.get("function_name", ""))
    if not function.endswith("plan"):
        raise MaskError(f"{source!r} is a dump of {function or 'an unnamed call'}; serve reads a wrapper's plan() call, "
                        f"which holds the batch's metadata (FLASHINFER_DUMP_INCLUDE='*.plan' keeps only those)")
    names = parameters(str(record.get("function_signature", "")))
    values = dict(record.get("input_metadata") or {})
    tensor_file = next((folder / n for n in ("inputs.pt", "inputs.safetensors") if (folder / n).is_file()), None)
    if tensor_file is not None:
        values.update(read_tensors(str(tensor_file), "FILE", numbers=True))
    # a method's positional arguments start at self where the dump kept it (its metadata names the object)
    self_first = names[:1] == ["self"] and isinstance(values.get("arg_0"), dict) and "repr" in values["arg_0"]
    offset = 0 if self_first or names[:1] != ["self"] else 1
    out = {}
    for key, value in values.items():
        if key.startswith("arg_") and key[4:].isascii() and key[4:].isdigit() and int(key[4:]) + offset < len(names):
            name = names[int(key[4:]) + offset]
        elif key.startswith("kwarg_"):
            name = key[len("kwarg_"):]
        else:
            continue
        if isinstance(value, dict) or value is None or isinstance(value, str):
            continue  # an object, a dtype, an enum or an unset argument: no batch metadata
        out[DECODE_NAMES.get(name, name)] = value
    if "Decode" in function and "paged_kv_indptr" in out:  # one new token per request
        out["qo_indptr"] = np.arange(len(np.asarray(out["paged_kv_indptr"])))
        out.setdefault("causal", 1)
    return out
