"""checks/singleton.py: a module's softmax over one element run at each step of one model call, caught in the
published bug's reproduction (tests/data/bugs) and in a program written another way (tests/data/singleton), quiet on
the fixes, on a softmax over one element run once per call, on a shared layer's single-token self-attention, on a
softmax over the steps together and on a neighbour loop whose line also softmaxes more elements; the weights checked against torch.softmax itself."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

import maskcli
from checkbugs import check_bug
from maskcli.checks.registry import severity

SINGLETON = Path(__file__).parent / "data" / "singleton"


def test_diens_augru_softmax_per_step_over_one_score_is_found(tmp_path):
    # datawhalechina/torch-rechub#229 (commit f072330): AUGRU_Cell.attention softmaxed (B, 1) at each of 6 behaviors
    found = check_bug(tmp_path, "torch_rechub_dien_augru_attention_softmax_singleton_axis_no_padding_mask",
                      "softmax-over-one")
    assert tuple(found[0]["cell"]) == (0, 0, 0)  # (batch row 0's one query, its one key: every cell is the same)
    assert "6 times in one call of AUGRU" in found[0]["message"] and "`augru_cell`" in found[0]["message"]


def test_a_temporal_attention_lstms_keepdim_softmax_per_step_is_found(tmp_path):
    # written otherwise: an LSTMCell loop, a keepdim sum (B, 1, 1), F.softmax over its last axis, right padding
    found = check_bug(tmp_path, "temporal_attention_lstm_per_step_softmax_keepdim", "softmax-over-one", folder=SINGLETON)
    assert "7 times in one call of TemporalAttentionLSTM" in found[0]["message"]


def test_a_softmax_over_one_element_weighs_every_score_one():
    scores = torch.randn(5, 1) * 100  # (the kernel's rule the finding states, by torch itself)
    assert torch.equal(torch.softmax(scores, dim=-1), torch.ones(5, 1))


class Memory(nn.Module):
    """One query against a memory of `m` elements, `steps` times (a decoder loop), scored by a dot product."""

    def __init__(self, steps, together=False):
        super().__init__()
        self.steps, self.together = steps, together

    def forward(self, query, memory):
        out = []
        for _ in range(self.steps):
            scores = (memory * query[:, None, :]).sum(-1)  # (B, m)
            weights = torch.softmax(scores, dim=-1)
            out.append((weights[..., None] * memory).sum(1))
        return torch.stack(out, 1)


class Shared(nn.Module):
    """One self-attention layer applied 3 times (ALBERT shares its layer), eager softmax over q @ kᵀ."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(4, 12)

    def forward(self, x):
        for _ in range(3):
            q, k, v = self.qkv(x).chunk(3, dim=-1)
            x = x + F.softmax(q @ k.transpose(-1, -2) / 2.0, dim=-1) @ v
        return x


class Neighbours(nn.Module):
    """Each point against its neighbours within a radius, one softmax per point: some points have one neighbour."""

    def forward(self, points, feats):
        out = []
        for i in range(points.shape[0]):
            near = ((points - points[i]).norm(dim=-1) < 0.3).nonzero().squeeze(1)
            weights = torch.einsum("hd,khd->hk", feats[i], feats[near]).softmax(-1)  # (heads, neighbours)
            out.append(torch.einsum("hk,khd->hd", weights, feats[near]))
        return torch.stack(out)


def _codes(module, *inputs) -> list:
    torch.manual_seed(0)
    with maskcli.trace() as t, torch.no_grad():
        module(*inputs)
    return [(f.code, severity(f)) for group in t.groups() for f in group.findings]


def test_one_element_once_a_single_tokens_shared_layer_and_a_softmax_over_steps_are_quiet():
    query = torch.randn(3, 4)
    assert ("softmax-over-one", "wrong") in _codes(Memory(4), query, torch.randn(3, 1, 4))  # (quiet below, each why)
    assert not [c for c in _codes(Memory(1), query, torch.randn(3, 1, 4)) if c[0] == "softmax-over-one"]  # once
    assert not [c for c in _codes(Memory(4), query, torch.randn(3, 5, 4)) if c[0] == "softmax-over-one"]  # 5 keys
    assert not [c for c in _codes(Shared(), torch.randn(2, 1, 4)) if c[0] == "softmax-over-one"]  # q @ kᵀ, 1 token
    points = torch.tensor([[0.0, 0.0], [0.1, 0.0], [5.0, 5.0], [0.0, 0.1], [9.0, 9.0]])  # points 2 and 4 alone
    assert not [c for c in _codes(Neighbours(), points, torch.randn(5, 2, 4)) if c[0] == "softmax-over-one"]
