"""Shared test set-up."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def cpu_unless_marked_cuda(request, monkeypatch):
    """The CLI's --device auto picks a GPU where there is one; tests not marked cuda compare with numbers
    computed on the CPU, so they pin it there (an explicit --device still wins)."""
    if request.node.get_closest_marker("cuda") is None:
        monkeypatch.setenv("MASKCLI_DEVICE", "cpu")
