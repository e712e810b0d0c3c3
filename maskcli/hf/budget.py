"""maskcli model's limits, and the work a run will take, said before any of it is done.

Light on purpose (no torch, no transformers): the command checks its numbers here before the 20 s import."""

from __future__ import annotations

MOST_TOKENS = 512  # a prompt row, and the decode steps: a tiny model on a CPU shows its masks well before this
MOST_ROWS = 16
