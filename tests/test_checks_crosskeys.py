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


class _Fusion(nn.Module):
    """Two cross-attention layers over a caption's states, as BridgeTower's cross-modal image layers."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(_Cross() for _ in range(2))

    def forward(self, x, memory):
        for layer in self.layers:
            x = layer(x, memory)
        return x


def test_another_model_holding_its_full_memory_at_the_same_step_is_no_sibling():
    """BridgeTower (written blind, quiet-r86b, a false alarm): its matching model and its masked-LM model each ran the
    padded batch (11 caption keys) and then every pair alone; at one step the masked-LM model's layers cross-attended a
    5-token caption while the matching model's held all 11, and that model's layers were read as siblings of the same
    decoder. Each model call holds its own memory: quiet. One model whose second layer alone keeps 3 keys while its
    first keeps all 6 is still said."""
    itm, mlm = _Fusion(), _Fusion()
    with maskcli.trace() as t, torch.no_grad():
        images = torch.randn(2, 1, 4, 4)
        for model in (itm, mlm):
            model(images, torch.randn(2, 1, 6, 4))  # the padded batch
        for length in (6, 3):  # the pairs alone: the matching model's caption, then the masked-LM model's
            itm(images[:1], torch.randn(1, 1, 6, 4))
            mlm(images[:1], torch.randn(1, 1, length, 4))
    flagged = [f for group in t.groups() for f in group.findings if f.code == "cross-memory-truncated"]
    assert flagged == []

    with maskcli.trace() as t, torch.no_grad():
        for step in range(2):
            memory = torch.randn(1, 1, 6, 4)
            x = itm.layers[0](images[:1], memory)
            itm.layers[1](x, memory if step == 0 else memory[:, :, 3:])  # the second layer's memory cut
    flagged = [f for group in t.groups() for f in group.findings if f.code == "cross-memory-truncated"]
    assert flagged and "layers.1 cross-attends 3 memory keys" in flagged[0].message, flagged
