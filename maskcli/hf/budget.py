"""maskcli model's limits, and the work a run will take, said before any of it is done.

Light on purpose (no torch, no transformers): the command checks its numbers here before the 20 s import."""

from __future__ import annotations

MOST_TOKENS = 512  # a prompt row, and the decode steps: a tiny model on a CPU shows its masks well before this
MOST_ROWS = 16
NOTICE_S = 30  # a run estimated past this says so up front, and what would shorten it

# Measured on a 2-core CPU (load 2-4), transformers 5.24, after the imports, at --lengths of 16 x 512 and
# --new-tokens 512: llama built tiny (2 layers) 49 s, gemma3_text (6 layers) 85 s; llama at 16 x 256 and 128 steps
# 14 s, at 4 x 128 and 128 steps 12 s. A step costs a near fixed 60 ms (generate, the trace's capture, the report)
# and each attention call in it 17.5 ms more; the mask's cells add little at these sizes.
PER_STEP_S = 0.06
PER_CALL_S = 0.0175


def estimate(layers: int, rows: int, width: int, new_tokens: int, prefill_chunk: int | None) -> tuple[float, str]:
    """Seconds a run will take, roughly, and the sizes that make them: one attention call per layer per step
    (the prefill, or its chunks and once more in one pass, then each decode step)."""
    steps = (1 if prefill_chunk is None else -(-width // prefill_chunk) + 1) + new_tokens
    seconds = steps * (PER_STEP_S + layers * PER_CALL_S)
    sizes = f"{steps:,} steps x {layers} layers x {rows} rows, up to {width + new_tokens:,} keys"
    return seconds, sizes


def notice(name: str, seconds: float, sizes: str) -> str | None:
    """The line said before a long run, or None for a short one."""
    if seconds < NOTICE_S:
        return None
    took = f"{seconds / 60:.0f} min" if seconds >= 90 else f"{seconds:.0f} s"
    return (f"model {name}: about {took} of work on a CPU ({sizes}); fewer --new-tokens or shorter --lengths "
            f"finish sooner (Ctrl-C stops it)")


class Steps:
    """generate's streamer (put once with the prompt, then once per generated token): each token is one step done,
    told to `update(done, total)` (maskcli.commands.progress draws it, on a terminal only)."""

    def __init__(self, update, total: int):
        self.update, self.total, self.done = update, total, -1

    def put(self, value) -> None:
        self.done += 1
        if self.done:
            self.update(self.done, self.total)

    def end(self) -> None:
        pass
