"""A mask from the user's own FlexAttention mask_mod, loaded behind --mask-mod FILE.py:NAME, as a kind of its own.

Loading it runs the user's code, so only that explicit flag loads it. The mask_mod is
called as FlexAttention calls it, with local indices (query row 0 is the first query,
key 0 the first key); maskcli's kinds work on absolute positions, so the kind made here
turns absolute positions back into local ones, and the name can stand in an expression:
"mine & ~causal". Its result is checked (a bool tensor of the right shape); an exception
in it is one line that names the user's file and line. A predicate has no intervals:
counts and maps go cell by cell.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import importlib.util
import inspect
import os
import re
import sys
import traceback
from pathlib import Path

from maskcli.errors import MaskError, Stopped
from maskcli.intervals import NotFew
from maskcli.kinds.base import Kind
from maskcli.sources.base import Source

SPEC = re.compile(r"^(?P<where>.+):(?P<name>[A-Za-z_][A-Za-z0-9_]*)$")


def looks_like_spec(text: str) -> bool:
    """FILE.py:NAME or package.module:NAME."""
    match = SPEC.match(text)
    return bool(match) and (match["where"].endswith(".py") or re.fullmatch(r"[A-Za-z_][\w.]*", match["where"]) is not None)


def load_function(spec: str, args: str | None = None) -> tuple[str, object, str]:
    """(name, mask_mod, where it came from) for FILE.py:NAME or package.module:NAME; a factory is called with args."""
    match = SPEC.match(spec)
    if match is None:
        raise MaskError(f"--mask-mod {spec!r}: give FILE.py:NAME or package.module:NAME, like masks.py:sliding_window")
    where, name = match["where"], match["name"]
    module = _module(where, spec)
    if not hasattr(module, name):
        found = ", ".join(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))[:200]
        raise MaskError(f"--mask-mod {spec!r}: {where} has no {name!r} (it has: {found or 'no functions'})")
    function = getattr(module, name)
    if not callable(function):
        raise MaskError(f"--mask-mod {spec!r}: {name} is a {type(function).__name__}, not a function")
    origin = _origin(function, where)
    if args is not None:
        values = _literals(args)
        try:
            with _user_code():
                function = function(*values)
        except BaseException as error:  # any exception out of the user's code, sys.exit too, is one line naming it
            _let_through(error)
            raise MaskError(f"--mask-mod-args {args!r}: {name}{tuple(values)!r} failed: {_where(error, origin)}") from None
        if not callable(function):
            raise MaskError(f"--mask-mod-args {args!r}: {name}(...) returned a {type(function).__name__}, not a mask_mod")
    else:
        arity = _arity(function)
        if arity is not None and arity != 4:
            raise MaskError(
                f"--mask-mod {spec!r}: {name} takes {arity} argument{'s' if arity != 1 else ''}, not a mask_mod's four "
                f"(b, h, q_idx, kv_idx): if it makes one, give its arguments with --mask-mod-args, like --mask-mod-args 4"
            )
    return name, function, origin


def _module(where: str, spec: str):
    if where.endswith(".py"):
        from maskcli.files import readable_file

        path = readable_file(where, f"--mask-mod {spec!r}: {where!r}")
        module_name = f"maskcli_user_{abs(hash(str(path.resolve())))}"
        loader = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(loader)
        sys.modules[module_name] = module
        try:
            with _user_code():
                loader.loader.exec_module(module)
        except BaseException as error:  # any exception out of the user's code, sys.exit too, is one line naming it
            _let_through(error)
            del sys.modules[module_name]
            raise MaskError(f"--mask-mod {spec!r}: loading {where} failed: {_where(error, str(path.resolve()))}") from None
        return module
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # package.module:NAME finds the user's package here, as `python -m` would
    try:
        with _user_code():
            return importlib.import_module(where)
    except BaseException as error:  # any exception out of the user's code, sys.exit too, is one line naming it
        _let_through(error)
        raise MaskError(f"--mask-mod {spec!r}: cannot import {where}: {_where(error, None)}") from None


def _let_through(error: BaseException) -> None:
    """Ctrl-C and a kill are the user's wish to stop, not their function failing: they go on up."""
    if isinstance(error, (KeyboardInterrupt, Stopped)):
        raise error


def _user_code():
    """While the user's code runs, its print() goes to stderr: stdout carries maskcli's --json or table alone.
    Not while torch.compile traces a mask_mod (flex_attention does), which cannot trace redirect_stdout."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.compiler.is_compiling():
        return contextlib.nullcontext()
    return contextlib.redirect_stdout(sys.stderr)


def _literals(text: str) -> tuple:
    """'4' or '4, \"a\"' -> (4,) or (4, 'a'): Python literals only, never evaluated code."""
    from maskcli.text import shortened

    quoted = repr(shortened(text, 60))
    try:
        value = ast.literal_eval(f"({text},)")
    except (MemoryError, RecursionError, SyntaxError, ValueError, TypeError) as error:
        if isinstance(error, (MemoryError, RecursionError)) or "nested" in str(error):  # the parser's own limits
            raise MaskError(f"--mask-mod-args {quoted} nests too deeply to read: give flat literals, like 4 or 4, 128") from None
        why = "an integer of more than 4,300 digits" if "digits" in str(error) else "not Python literals separated by commas"
        raise MaskError(f"--mask-mod-args {quoted} is {why}: give literals like 4 or 4, 128") from None
    return tuple(value)


def _arity(function) -> int | None:
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in parameters):
        return None
    return sum(1 for p in parameters if p.default is p.empty)


def _origin(function, fallback: str) -> str:
    try:
        return str(Path(inspect.getsourcefile(function)).resolve())
    except (TypeError, OSError):
        return fallback


def _where(error: BaseException, origin: str | None) -> str:
    """'ValueError: ... (masks.py line 7)': the last line of the user's own file in the traceback (`origin`; None
    for a module found by import: the last line of any file outside maskcli and Python's import machinery)."""
    frames = traceback.extract_tb(error.__traceback__)
    if origin is not None:
        frames = [frame for frame in frames if str(Path(frame.filename).resolve()) == origin]
    else:
        ours = str(Path(__file__).resolve().parent)
        frames = [frame for frame in frames if not frame.filename.startswith("<") and not str(Path(frame.filename).resolve()).startswith(ours)]
    place = f" ({Path(frames[-1].filename).name} line {frames[-1].lineno})" if frames else ""
    message = " ".join(str(error).split())[:200]
    return f"{type(error).__name__}: {message}{place}"


def kind(name: str, function, origin: str) -> Kind:
    """The user's mask_mod as a kind with no parameters, for expressions."""

    def intervals(p, frame):
        raise NotFew(f"{name} is a mask_mod: a predicate, counted cell by cell")

    def predicate(p, frame, device):
        q0, k0 = frame.q_start, frame.k_start

        def user(b, h, q_idx, kv_idx):
            return call(name, function, origin, b, h, q_idx - q0, kv_idx - k0)

        return user

    return Kind(
        name=name,
        meaning=f"your mask_mod {name} from {Path(origin).name}",
        keep=f"{name}(b, h, q - q_start, kv - k_start)",
        params=(),
        example=name,
        intervals=intervals,
        predicate=predicate,
        rank=100,
        per_head=True,
    )


def call(name: str, function, origin: str, b, h, q_idx, kv_idx):
    """The user's function on broadcast index tensors (or through vmap, as create_mask calls it), checked."""
    import torch

    with _user_code():
        try:
            out = function(b, h, q_idx, kv_idx)
        except BaseException as error:  # any exception out of the user's code, sys.exit too, is one line naming it
            _let_through(error)
            if _needs_scalars(error) and q_idx.dim() == 4:
                out = _vmapped(name, function, origin, b, h, q_idx, kv_idx)
            else:
                raise MaskError(f"your mask_mod {name} raised {_where(error, origin)}") from None
    if not isinstance(out, torch.Tensor):
        raise MaskError(f"your mask_mod {name} returned a {type(out).__name__}; a mask_mod returns a bool tensor, like kv_idx <= q_idx")
    if out.device.type == "meta" or out.layout != torch.strided:
        raise MaskError(f"your mask_mod {name} returned a {out.device.type if out.device.type == 'meta' else out.layout} tensor; a mask_mod returns a plain bool tensor, like kv_idx <= q_idx")
    if out.dtype != torch.bool:
        raise MaskError(
            f"your mask_mod {name} returned {str(out.dtype).removeprefix('torch.')} values; a mask_mod returns bool "
            "(True = may attend): compare, like kv_idx <= q_idx, instead of computing a number"
        )
    expected = torch.broadcast_shapes(b.shape, h.shape, q_idx.shape, kv_idx.shape)
    try:
        if torch.broadcast_shapes(out.shape, expected) != expected:
            raise RuntimeError
    except RuntimeError:
        raise MaskError(
            f"your mask_mod {name} returned shape {list(out.shape)} for indices of shape {list(expected)}: "
            "return one value per (b, h, q_idx, kv_idx), computed from them elementwise"
        ) from None
    return out


def _needs_scalars(error: Exception) -> bool:
    """Python control flow on a tensor (`if q_idx > kv_idx:`) works only under vmap, one cell at a time."""
    return isinstance(error, RuntimeError) and "ambiguous" in str(error)


def _vmapped(name, function, origin, b, h, q_idx, kv_idx):
    from torch.func import vmap

    inner = function
    for dim in range(3, -1, -1):  # vmap over kv, then q, h, b: one scalar each, as create_mask does
        in_dims = [None] * 4
        in_dims[dim] = 0
        inner = vmap(inner, in_dims=tuple(in_dims))
    try:
        return inner(b.flatten(), h.flatten(), q_idx.flatten(), kv_idx.flatten())
    except BaseException as error:  # any exception out of the user's code, sys.exit too, is one line naming it
        _let_through(error)
        raise MaskError(f"your mask_mod {name} raised {_where(error, origin)}") from None


def kinds(spec: str | None, args: str | None) -> dict:
    """{name: kind} for --mask-mod, loaded (running the user's code) only when that flag is given."""
    if spec is None:
        if args is not None:
            raise MaskError("--mask-mod-args is for --mask-mod: give --mask-mod FILE.py:NAME too")
        return {}
    from maskcli.kinds import names

    name, function, origin = load_function(spec, args)
    if name in names() or name == "prefill":
        raise MaskError(f"--mask-mod {spec!r}: {name} is the name of a maskcli kind; rename your function or import it under another name")
    return {name: kind(name, function, origin)}


def load(spec: str, options, default_length: int | None = None):
    """The mask the mask_mod `spec` names, standing alone over the sizes the options give."""
    from maskcli.mask import build

    found = kinds(spec, options.mask_mod_args)
    return build(next(iter(found)), options, default_length=default_length, kinds=found)


SOURCE = Source("usermod", load)
