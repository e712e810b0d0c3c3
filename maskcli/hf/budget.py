"""maskcli model's limits, and the work a run will take, said before any of it is done.

Light on purpose (no torch, no transformers): the command checks its numbers here before the 20 s import."""

from __future__ import annotations

MOST_TOKENS = 512  # a prompt row, and the decode steps: a tiny model on a CPU shows its masks well before this
MOST_ROWS = 16
NOTICE_S = 30  # a run estimated past this says so up front, and what would shorten it

# Measured on a 2-core CPU (load 2-4), transformers 5.24, llama built tiny (2 layers): every attention call costs a
# roughly fixed 50-60 ms under the trace, from capture to the report (16 rows x 256 keys x 129 steps: 22 s, of which
# 7.6 s is importing torch and transformers, done before the estimate; 4 x 128 x 129: 19 s); the cells a call's mask holds add the rest.
PER_CALL_S = 0.055
PER_CELL_S = 2e-8


def estimate(layers: int, rows: int, width: int, new_tokens: int, prefill_chunk: int | None) -> tuple[float, str]:
    """Seconds a run will take, roughly, and the sizes that make them: one attention call per layer per step
    (the prefill, or its chunks and once more in one pass, then each decode step), each a (rows, queries, keys) mask."""
    chunks = 1 if prefill_chunk is None else -(-width // prefill_chunk) + 1
    steps = chunks + new_tokens
    prefill_cells = rows * width * width * (2 if prefill_chunk else 1)
    decode_cells = rows * sum(range(width + 1, width + new_tokens + 1))  # one query over width + t keys at step t
    seconds = layers * (steps * PER_CALL_S + (prefill_cells + decode_cells) * PER_CELL_S)
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
