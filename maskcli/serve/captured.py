"""Batches a traced vLLM engine built (maskcli/trace/vllm.py), each read and checked as `serve` reads a field file."""

from __future__ import annotations

from dataclasses import dataclass

from maskcli.errors import MaskError
from maskcli.serve.batch import ServeBatch


@dataclass(frozen=True)
class Checked:
    """One captured build() (maskcli.trace.vllm.Step: step, builder, layers, fields), the batch serve reads from its
    fields, and the findings."""

    captured: object
    batch: ServeBatch | None
    findings: list
    error: str | None = None  # why serve could not read it (the fields say what the engine passed)

    @property
    def source(self) -> str:
        return f"vllm step {self.captured.step}"


def check_steps(steps) -> list[Checked]:
    """Each captured step (step, builder, layers, fields) read under vLLM's names and checked as serve checks a file."""
    from maskcli.checks.servecheck import check
    from maskcli.serve.engines import from_tensors

    out = []
    for s in steps:
        source = f"vllm step {s.step}"
        try:
            batch = from_tensors(s.fields, source)
        except MaskError as error:
            out.append(Checked(s, None, [], str(error)))
            continue
        out.append(Checked(s, batch, check(batch)))
    return out
