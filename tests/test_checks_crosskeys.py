"""checks/crosskeys.py: a cross-attention layer whose encoder memory shrinks at a later step while another
cross-attention layer still sees all of it."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

import maskcli
from checkbugs import check_bug
from maskcli.checks.registry import severity

FOLDER = Path(__file__).parent / "data" / "crosskeys"


def test_t5gemma_cross_attention_cache_built_from_the_decoder_config(tmp_path):
    # huggingface/transformers#46111 (written blind): the sliding layer's cross-attention keeps its last W - 1 encoder
    # states from the second step on (SDPA, the module's is_cross_attention)
    flagged = check_bug(tmp_path, "t5gemma_cross_attention_cache_inherits_sliding_window", "cross-memory-truncated")
    assert any("0.cross_attn cross-attends 3 memory keys" in f["message"] for f in flagged), flagged


def test_a_local_layers_cache_reused_for_its_memory(tmp_path):
    # written otherwise: a softmax over matmul scores, a batch of 2, the memory argument says cross-attention
    flagged = check_bug(tmp_path, "cross_cache_ring_trims_memory", "cross-memory-truncated", FOLDER)
    assert any("1.src cross-attends 3 memory keys" in f["message"] for f in flagged), flagged


class _Cross(nn.Module):
    def forward(self, x, memory):
        return nn.functional.scaled_dot_product_attention(x, memory, memory)


def _codes(lengths: list[int]) -> list:
    layers = nn.ModuleList(_Cross() for _ in range(2))
    with maskcli.trace() as t, torch.no_grad():
        for length in lengths:  # one generation of 2 steps per memory
            memory = torch.randn(1, 1, length, 4)
            for _ in range(2):
                x = torch.randn(1, 1, 1, 4)
                for layer in layers:
                    x = layer(x, memory)
    return sorted({(f.code, severity(f)) for group in t.groups() for f in group.findings if severity(f) != "note"})


def test_a_new_generation_over_a_shorter_memory_is_quiet():
    # every layer's memory shrinks together (another source): nothing says it was cut
    assert _codes([7, 4]) == []
    assert _codes([7]) == []


def test_references_of_one_patch_each_beside_a_file_named_for_cross_attention_are_quiet(tmp_path):
    """BLT (written blind, quiet-r73a, a false alarm): its self-check ran each patch's cross-attention over that patch's
    bytes alone, beside SDPA self-attention references named by their line of a file called
    quiet_blt_patch_cross_attn_...py; the file's name was read as a cross-attention's module path, so the references
    seemed a sibling layer holding the full memory. A file's name is no module's. Written another way here (its name
    holds "cross_attention"): quiet, and every patch matches its bytes alone."""
    from checkbugs import traced

    status, found, report = traced(tmp_path, "patch_cross_attention_checked_patch_by_patch", False, FOLDER)
    assert status == 0 and not [f for f in found if f["code"] == "cross-memory-truncated"], report
    assert "every patch matches its bytes alone" in report, report
