"""Small helpers that put numbers into words, and the Finding that findings are made of."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Finding:
    code: str  # short, stable: fully-masked, row-sum, sees-later, fill-overflow, non-finite
    message: str


def spans(values: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'."""
    parts: list[str] = []
    start = prev = None
    for value in values:
        if start is None:
            start = prev = value
        elif value == prev + 1:
            prev = value
        else:
            parts.append(f"{start}" if start == prev else f"{start}-{prev}")
            start = prev = value
    if start is not None:
        parts.append(f"{start}" if start == prev else f"{start}-{prev}")
    return ", ".join(parts)


def shell_quote(text: str) -> str:
    """A command-line word: bare where the shell leaves it alone, else in double quotes where that is safe."""
    import shlex

    if all(c.isalnum() or c in "_-.,/=:+" for c in text) and text:
        return text
    if not any(c in text for c in '"$`\\!'):
        return f'"{text}"'
    return shlex.quote(text)


def shortened(text: str, limit: int = 100) -> str:
    """Text for a header or title: whole up to `limit` characters, else its start and end around '...'."""
    if len(text) <= limit:
        return text
    tail = max(10, limit // 5)
    return f"{text[: limit - tail - 5]} ... {text[-tail:]}"


def step_label(step: int, q_len: int) -> str:
    """A module's call number in words: 'prefill' (its first call, of several queries), 'decode N' (a one-query call
    after the first), else 'step N'; N is the number TRACE.pt:PATH@N selects."""
    if step == 0 and q_len > 1:
        return "prefill"
    return f"decode {step}" if q_len == 1 and step > 0 else f"step {step}"


def step_text(steps: list[int], q_len: int) -> str:
    """The calls of a group in the words of step_label: 'prefill', 'decode 1-3', 'prefill, steps 1-2', 'step 0, decode 1'."""
    words = ["prefill"] if q_len > 1 and 0 in steps else ["step 0"] if 0 in steps else []
    rest = [step for step in steps if step > 0]
    if rest:
        words.append(("decode " if q_len == 1 else "step " if len(rest) == 1 else "steps ") + spans(rest))
    return ", ".join(words)
