"""What a program's variables say as configs, beside what they hold: which is named as a config, which two are the
same, and a config.json kept as text (trace/stated.py's `_variables` reads the program's frames with them)."""

from __future__ import annotations


def config_named(variable: str, value) -> bool:
    """The variable or its class is named as a config is (`config`, `cfg`, `model_args`, `class GPTConfig`), not as a
    step's runtime object (`md`, `common`, `FlashAttentionMetadata`)."""
    from maskcli.checks.intent import LIKE

    names = (variable.lower(), type(value).__name__.lower())
    return any(word in name for name in names for word in (*LIKE, "cfg")) and "metadata" not in names[1]


def same_fields(a: dict, b: dict) -> bool:
    """Two configs' fields are equal (the one config a module holds, found again among the program's variables)."""
    try:
        return bool(a == b)
    except (Exception, SystemExit):  # noqa: BLE001 - values that do not compare (arrays): not the same
        return False


def json_object(text: str) -> dict | None:
    """The dict a JSON object's text holds where it names one of the attention fields (a config.json the program keeps
    as text); None for any other string (read only where it starts with "{" and is short)."""
    import json

    from maskcli.checks.intent import FIELDS

    if len(text) > 100_000 or not text.lstrip().startswith("{") or not any(f'"{name}"' in text for name in FIELDS):
        return None
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None
