"""Reading a config of the program's as a rule needs it, and which of a transformers config's fields the program set.

A config's attributes are read statically where its class answers reads with code of the program's own (`read`,
`StaticView`: never its __getattr__, which python would not have run).

A transformers config's `is_causal` is usually a class's default for one part of a composite model (checks/dropped.py
leaves those alone). One that the config's class defines nowhere (no dataclass field, no __init__ parameter, no class
attribute, no attribute_map entry) was set by the program (`config.is_causal = True` on a ModernBertConfig:
FGA-DIKU/BONSAI#343), and is the program's own word, as a field of a config of its own would be (`added`).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect

MISSING = object()
LIBRARIES = ("builtins", "transformers", "torch", "argparse", "types", "collections", "omegaconf", "dataclasses")


def dynamic(value) -> bool:
    """The object's class answers attribute reads with code of the program's own: a __getattr__ or __getattribute__
    defined by a class that is not the standard library's, torch's or transformers'. Reading a name such an object
    lacks runs the program's code (it may count, print or change state), which a trace must not: python would not."""
    kind = type(value)
    try:
        return _dynamic(kind)
    except TypeError:  # (a class that cannot be a key)
        return _dynamic.__wrapped__(kind)


@functools.lru_cache(maxsize=4096)
def _dynamic(kind: type) -> bool:
    """dynamic, once per class (trace asks it of every attending module and its config, at every call)."""
    for base in kind.__mro__[:-1]:
        held = vars(base)
        if ("__getattr__" in held or "__getattribute__" in held) and \
                str(getattr(base, "__module__", "")).split(".")[0] not in LIBRARIES:
            return True
    return False


def read(value, name: str, default=None):
    """getattr(value, name, default) as a config reader needs it: never raising (a property of the program's that raises
    states nothing), and on a `dynamic` object a static read (its own and its class's attributes, properties run as
    written), never its __getattr__."""
    try:
        if not dynamic(value):
            return getattr(value, name, default)
        found = inspect.getattr_static(value, name, MISSING)
        if found is MISSING:
            return default
        getter = getattr(type(found), "__get__", None)
        return found if getter is None else getter(found, value, type(value))
    except Exception:  # noqa: BLE001 - the program's own code raising inside a read: not stated
        return default


PLAIN = (int, float, str, bool, tuple, list, dict, type(None))


def class_fields(value) -> dict:
    """The plain values (numbers, strings, tuples, lists, dicts) a config's own classes hold as class attributes, the
    outermost class's over its bases': a config written `class ModelConfig: num_layers = 2; attention_types = (...)`
    states them though its instance holds none (tunix's Gemma 4 port). None from a library's class (transformers'
    configs' class defaults are not the program's statement) nor from private names."""
    found: dict = {}
    for base in reversed(type(value).__mro__[:-1]):
        if str(getattr(base, "__module__", "")).split(".")[0] in LIBRARIES:
            continue
        found.update((name, held) for name, held in vars(base).items()
                     if isinstance(name, str) and not name.startswith("_") and isinstance(held, PLAIN))
    return found


def field_reader(config):
    """A reader of `config`'s fields by name, whatever keeps them: a dict's keys, else `read` (an object, a dataclass, a
    dynamic config read statically)."""
    return config.get if isinstance(config, dict) else (lambda name: read(config, name))


class StaticView:
    """A `dynamic` config as the checks read it after the run: its attributes read by `read`, never by its __getattr__,
    so that no rule runs the program's attribute code (trace/tops.py keeps a model's config so)."""

    __slots__ = ("_held",)

    def __init__(self, held):
        object.__setattr__(self, "_held", held)

    def __getattr__(self, name):
        found = read(self._held, name, MISSING)
        if found is MISSING:
            raise AttributeError(name)
        return found

    @property
    def __dict__(self):
        try:
            return dict(vars(self._held))
        except TypeError:
            return {}


def added(value, names) -> tuple[str, ...]:
    """The `names` (fields the config `value` states) that its class defines nowhere, sorted; () where it defines all."""
    kind = type(value)
    defined = set(getattr(kind, "attribute_map", None) or {})
    if dataclasses.is_dataclass(kind):
        defined |= {field.name for field in dataclasses.fields(kind)}
    try:
        defined |= set(inspect.signature(kind.__init__).parameters)
    except (TypeError, ValueError):
        return ()  # (a class whose parameters cannot be read: nothing said to be the program's)
    return tuple(sorted(name for name in names if name not in defined
                        and not any(name in vars(base) for base in kind.__mro__)))


def text_part(config):
    """The text part of a composite transformers config (Gemma 3's text_config), as get_text_config() names it; the
    config itself where it has neither that method nor a `text_config` object (a port's dataclass), or where it has several text parts and names none (MusicGen's
    text_encoder and decoder: get_text_config() raises ValueError), so no rule reads one part's fields for another's."""
    found = getattr(config, "get_text_config", None)
    if not callable(found):  # (a port's composite config of its own: its `text_config` field, as transformers' names it)
        held = getattr(config, "text_config", None)
        return config if held is None or isinstance(held, (dict, str, int, float, bool)) else held
    try:
        return found()
    except ValueError:
        return config


def same(a, b) -> bool:
    """a == b as a bool; False for values that do not compare (a tensor's, a program's __eq__ that raises)."""
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - values that do not compare: not the same
        return False
