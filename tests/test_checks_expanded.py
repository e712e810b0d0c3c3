"""checks/expanded.py: packed-document boundaries made over the model call's ids, handed to a layer that attends over
more tokens (the ids expanded inside the model), on the published bug's reproduction and a program written otherwise;
the counts against the program's own ids and expansion worked out here."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from checkbugs import check_bug
from maskcli.trace.packed import handed

PACKED = Path(__file__).parent / "data" / "packed"


def _expanded(ids: list[int], placeholder: int, width: int) -> int:
    """How many tokens the ids become, each placeholder `width` embeddings (a loop over the ids)."""
    return sum(width if t == placeholder else 1 for t in ids)


def test_megatron_llava_cu_seqlens_left_in_collapsed_space(tmp_path):
    # NVIDIA/Megatron-LM#3427: PackedSeqParams.cu_seqlens_q/kv not remapped after image expansion
    found = check_bug(tmp_path, "megatron_llava_packed_cu_seqlens_collapsed", "documents-unexpanded")
    ids = [5, -200, 11, 12, 7, 8, -200, 21, 22]
    tokens = _expanded(ids, -200, 3)
    assert len(found) == 1  # (once for the model call, though every layer is handed the same boundaries)
    assert f"end at {len(ids)}, the {len(ids)} token ids" in found[0]["message"]
    assert f"attends over {tokens} tokens" in found[0]["message"]
    assert f"tokens {len(ids)}-{tokens - 1} are in no document" in found[0]["message"]


def test_audio_frames_cu_seqlens_handed_by_keyword(tmp_path):
    found = check_bug(tmp_path, "audio_frames_cu_seqlens_not_remapped", "documents-unexpanded", PACKED)
    ids = [3, 99, 4, 5, 6, 99, 7]
    tokens = _expanded(ids, 99, 4)
    assert f"attends over {tokens} tokens" in found[0]["message"] and "cu_seqlens handed to blocks.0" in found[0]["message"]


def test_documents_handed_by_keyword_or_in_an_argument_object():
    class PackedSeqParams:
        def __init__(self, cu):
            self.qkv_format, self.cu_seqlens_q, self.cu_seqlens_kv = "thd", cu, cu

    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    hidden = torch.zeros(13, 1, 32)  # [s, b, h]
    given, tokens = handed({"args": (hidden, PackedSeqParams(cu)), "kwargs": {}})
    assert sorted(given) == ["cu_seqlens_kv", "cu_seqlens_q"] and tokens == 13
    given, tokens = handed({"args": (torch.zeros(2, 5, 8),), "kwargs": {"cu_seqlens": cu}})
    assert np.array_equal(given["cu_seqlens"], cu) and tokens == 10
    assert handed({"args": (hidden, object()), "kwargs": {"mask": None}}) is None


def test_an_argument_whose_attribute_code_raises_is_read_statically():
    class Slotted:  # (no instance dict: getattr(x, "__dict__") would reach its __getattr__, which raises KeyError)
        __slots__ = ("cu",)

        def __getattr__(self, name):
            raise KeyError(name)

    hidden = torch.zeros(13, 1, 32)
    assert handed({"args": (hidden, Slotted()), "kwargs": {}}) is None
