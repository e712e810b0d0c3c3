"""Everything inspect says about a tensor, at once: convention, shape, APIs, structure, findings."""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from maskcli.checks import registry
from maskcli.inspect.apis import api_fits, broadcast_text
from maskcli.inspect.polarity import Convention, check_maskable, classify, marks, sdpa_view, to_keep
from maskcli.inspect.structure import Structure, recognise
from maskcli.tensorfile import dtype_name


@dataclass(frozen=True)
class Analysis:
    tensor: np.ndarray  # the file's values (bfloat16 widened: tensorfile.BFLOAT16)
    convention: Convention
    keep4: np.ndarray  # bool (B, H, Lq, Lk) as shown: SDPA's view, or [B, 1, 1, S] for a key padding reading
    structure: Structure
    findings: list
    apis: list
    broadcast: str
    as_sdpa: np.ndarray  # bool (B, H, Lq, Lk): the keep cells as SDPA reads them, whatever reading was chosen
    q_offset: int  # the absolute position of query row 0 (_q_offset): a value, as the rules read it

    def report(self, source: str) -> dict:
        """Everything said about the tensor, JSON-ready."""
        structure = self.structure
        return {
            "file": source,
            "dtype": dtype_name(self.tensor),
            "shape": list(self.tensor.shape),
            "broadcast": self.broadcast,
            "as_4d": list(sdpa_view(self.tensor).shape),
            "apis": self.apis,
            "convention": self.convention.name,
            "convention_sure": self.convention.sure,
            "convention_how": self.convention.how,
            "convention_note": self.convention.note,
            "sentinel": self.convention.sentinel,
            "ones_mean": self.convention.ones_mean if self.convention.name == "int" else None,
            "structure": structure.expression,
            "kind": structure.kind,
            "reading": structure.reading,
            "params": structure.params,
            "command": structure.command,
            "also": structure.also,
            "structure_note": structure.note,
            "closest": structure.closest,
            "findings": [{"code": f.code, "message": f.message} for f in self.findings],
        }


def _q_offset(structure: Structure, keep4: np.ndarray) -> int:
    """The absolute position of query row 0: the kind's own, else bottom-right alignment (maskcli's reading)."""
    if structure.reading != "mask":
        return 0
    if structure.mask is not None:
        return structure.mask.q_offset
    return max(0, keep4.shape[-1] - keep4.shape[-2])


def analyse(tensor, heads: int | None = None, convention: Convention | None = None, padding: dict | None = None,
            where: str = "the tensor") -> Analysis:
    """Classify, recognise and find what is wrong, in one go; `convention` overrides the classification.

    `tensor`: a numpy array as sources/tensor.py's load_mask gives it, or a torch tensor, checked and converted here.
    `padding`: a traced call's key padding argument (maskcli.keypadding fields), where its API had one.
    `where`: the tensor's name in a refusal (its file, as the user gave it)."""
    tensor = check_maskable(tensor, where)
    convention = convention or classify(tensor, where)
    keep = to_keep(tensor, convention)
    keep4 = as_sdpa = sdpa_view(keep)
    structure = convention.structure if padding is None else None  # polarity's, where the structure told it
    if structure is None:
        structure = recognise(keep4, key_padding=tensor.ndim == 2, marked=marks(convention), nearest=True, padding=padding)
    key_padding = structure.reading == "key padding [B, S]"
    if key_padding:
        keep4 = keep[:, None, None, :]
    analysis = Analysis(tensor, convention, keep4, structure, [], api_fits(tensor, convention, key_padding),
                        broadcast_text(tensor), as_sdpa, _q_offset(structure, keep4))
    # every rule given a tensor (checks/registry.py), those whose code a trace group's rule finds too among them
    return replace(analysis, findings=registry.run("tensor", analysis, heads))

