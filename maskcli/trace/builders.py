"""A decoder of the program's own whose code holds a causal-mask builder (checks/directions.py reads it).

A module class named a decoder (`TransformerDecoder`, `DecoderLayer`) in the program's own files, whose module's
globals or own class hold a function named as a causal mask's builder (ESPnet's `subsequent_mask`, fairseq's
`buffered_future_mask`, `generate_square_subsequent_mask`, `causal_mask`, `nopeak_mask`): the program builds its
decoder's self-attention causal; a decoder self-attention that sees later tokens never got that mask. Read once per
class (every attention call passes here: a few dict lookups per module on the stack), nothing called.
"""

from __future__ import annotations

import functools
import os
import re
import sysconfig

BUILDER = re.compile(r"_*(?:(?:get|make|build|create|generate|gen|buffered|square|apply)_)*(?:(?:attn|attention)_)?"
                     r"(?:subsequent|causal|future|look_?ahead|no_?peak|autoregressive)_(?:attn_|attention_)?mask",
                     re.IGNORECASE)  # a builder's whole name (fairseq's buffered_future_mask, torch's
# generate_square_subsequent_mask, nlp-tutorial's get_attn_subsequent_mask), not a name that mentions one (a test's)
DECODER = re.compile(r"decoder", re.IGNORECASE)
WORDS = re.compile(r"[A-Z]+(?=[A-Z][a-z])|[A-Z]?[a-z]+|[A-Z]+")  # a CamelCase name's words
NOT_AUTOREGRESSIVE = {"na", "nat", "nar", "mlm", "cmlm", "masked", "bidirectional", "nonautoregressive", "non",
                      "levenshtein", "insertion"}  # (a decoder that names itself not causal: Mask-CTC's MLMDecoder)


def causal_builder(stack: list) -> str | None:
    """'subsequent_mask() beside DecoderLayer in FILE' for the innermost decoder class of the program's own on `stack`
    whose code holds a causal-mask builder; None where none does. A module of the program's own that says it is a
    decoder itself (`self.is_decoder = True`, as T5's blocks and BERT's layers do) is one too, its builder held by its
    class or by the class of a module inside it on the stack (TransformerLens' T5Block around an attention whose class
    holds `apply_causal_mask`); one that says False (an encoder's block) speaks for what is inside it: no decoder."""
    for at in range(len(stack) - 1, -1, -1):
        module = stack[at]
        flag = _own_flag(module)
        if flag is False:
            return None
        found = _of_class(type(module))
        if found is STOP:
            return None
        if found is not None:
            return found
        if flag is True:
            return _held_inside(stack[at:])
    return None


def _own_flag(module) -> bool | None:
    """The module's own bool `is_decoder`, where its class is the program's own; None elsewhere."""
    try:
        flag = vars(module).get("is_decoder")
    except TypeError:
        return None
    if not isinstance(flag, bool):
        return None
    forward = getattr(type(module), "forward", None)
    code = getattr(forward, "__code__", None)
    return flag if code is not None and _own(code.co_filename) else None


def _held_inside(modules: list) -> str | None:
    """The builder the code of the first of `modules` (a module that says it is a decoder) or of one inside it holds."""
    for module in modules:
        names = _builders(type(module))
        if names:
            return f"{names[0]}() beside {type(modules[0]).__name__} (is_decoder=True) in {names[1]}"
    return None


@functools.lru_cache(maxsize=1024)
def _builders(cls) -> tuple:
    """(builder name, file) that a class of the program's own holds (its methods, its forward's globals); () if none."""
    forward = vars(cls).get("forward") or getattr(cls, "forward", None)
    code = getattr(forward, "__code__", None)
    if code is None or not _own(code.co_filename):
        return ()
    names = [key for klass in cls.__mro__ if klass.__module__ == cls.__module__ for key in vars(klass)
             if BUILDER.fullmatch(key) and callable(vars(klass)[key])]
    names += [key for key, value in getattr(forward, "__globals__", {}).items() if _builder(key, value)]
    return (names[0], os.path.basename(code.co_filename)) if names else ()


def _builder(name: str, value) -> bool:
    """A module global that builds a causal mask: a function named as one (`subsequent_mask`), or a class of the
    program's own named so in CamelCase (tfts' `CausalMask(B, L).mask`, a TensorFlow port's)."""
    if isinstance(value, type):
        return _own_class(value) and BUILDER.fullmatch("_".join(WORDS.findall(name))) is not None
    return callable(value) and BUILDER.fullmatch(name) is not None


def _own_class(cls) -> bool:
    init = getattr(vars(cls).get("__init__"), "__code__", None)
    return init is not None and _own(init.co_filename)


STOP = False  # an encoder, or a decoder that names itself not autoregressive: no decoder around it speaks for it


@functools.lru_cache(maxsize=1024)
def _of_class(cls) -> str | None:
    """The builder a decoder class's code holds; STOP for an encoder, or a decoder that names itself not autoregressive;
    None for a class that is no decoder of the program's, or one whose code holds no builder (a layer's class, the
    builder on the decoder around it)."""
    name = cls.__name__
    words = {word.lower() for word in WORDS.findall(name)}
    if "encoder" in words and "decoder" not in words:
        return STOP  # an encoder's call, whatever seq2seq model holds it (the Annotated Transformer's EncoderDecoder)
    if not DECODER.search(name) or "encoder" in name.lower():
        return None  # (a whole encoder-decoder speaks for neither part)
    if NOT_AUTOREGRESSIVE & words:
        return STOP
    forward = vars(cls).get("forward") or getattr(cls, "forward", None)
    code = getattr(forward, "__code__", None)
    if code is None or not _own(code.co_filename):
        return None  # (a library's decoder: torch's nn.TransformerDecoder is DETR's too, run without a causal mask)
    names = [key for klass in cls.__mro__ if klass.__module__ == cls.__module__ for key in vars(klass)
             if BUILDER.fullmatch(key) and callable(vars(klass)[key])]
    held = getattr(forward, "__globals__", {})
    names += [key for key, value in held.items() if _builder(key, value)]
    if not names:
        return None
    return f"{names[0]}() beside {name} in {os.path.basename(code.co_filename)}"


@functools.cache
def _libraries() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return tuple({paths[key] for key in ("stdlib", "platstdlib", "purelib", "platlib")} | {here})


def _own(filename: str) -> bool:
    """A file of the program's own: not the standard library's, an installed library's, maskcli's or frozen code."""
    return not filename.startswith("<") and not os.path.abspath(filename).startswith(_libraries())
