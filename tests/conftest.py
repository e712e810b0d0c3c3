"""Shared test set-up."""

from __future__ import annotations

import sys

import pytest

try:  # (the vLLM venv runs tests/test_trace_vllm.py with pytest alone: no property tests there)
    from hypothesis import HealthCheck, settings
except ImportError:
    pass
else:  # property tests run on shared, loaded machines: a slow draw is the machine's, not a failure of the property
    settings.register_profile("maskcli", deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    settings.load_profile("maskcli")


@pytest.fixture(autouse=True)
def cpu_unless_marked_cuda(request, monkeypatch):
    """The CLI's --device auto picks a GPU where there is one; tests not marked cuda compare with numbers
    computed on the CPU, so they pin it there (an explicit --device still wins)."""
    if request.node.get_closest_marker("cuda") is None:
        monkeypatch.setenv("MASKCLI_DEVICE", "cpu")


@pytest.fixture(autouse=True)
def torch_global_state_restored():
    """A program traced in the test's process (CliRunner's `maskcli trace`, `maskcli.trace()`) may set torch's default
    dtype (float64, for a reference computed exactly) or turn autograd off at its top level
    (`torch.set_grad_enabled(False)`, ColBERT's inference script) and leave it so, as a script may: the next test's
    program would run in it. Each test starts in the dtype and grad mode the one before it started in."""
    torch = sys.modules.get("torch")
    dtype = None if torch is None else torch.get_default_dtype()
    grad = True if torch is None else torch.is_grad_enabled()
    yield
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_default_dtype(dtype or torch.float32)
        torch.set_grad_enabled(grad)


@pytest.fixture(autouse=True)
def no_terminal_width(monkeypatch):
    """Output under test is piped output: a COLUMNS the shell or a machine exports (80 on some) would wrap the
    expected text; a test about width sets COLUMNS itself."""
    monkeypatch.delenv("COLUMNS", raising=False)



# CI runs README's test command on a clean install first, then installs the hf extra and chromium and runs
# again only what that first run skipped (`pytest --skipped-before`): the skipped tests' ids are kept in
# pytest's cache (.pytest_cache) between the two runs.
SKIPPED_KEY = "maskcli/skipped"
_skipped: set[str] = set()


def pytest_addoption(parser):
    parser.addoption("--skipped-before", action="store_true",
                     help="run only the tests (and test files) the previous run skipped, e.g. after installing an extra")


def pytest_collectreport(report):
    """A test file that skips as a whole (pytest.importorskip at its top) is reported here, not per test."""
    if report.skipped and report.nodeid:
        _skipped.add(report.nodeid)


def pytest_runtest_logreport(report):
    if report.skipped:
        _skipped.add(report.nodeid)


def pytest_collection_modifyitems(config, items):
    if not config.getoption("--skipped-before") or getattr(config, "cache", None) is None:
        return
    before = config.cache.get(SKIPPED_KEY, [])
    def skipped(item) -> bool:
        return item.nodeid in before or any(item.nodeid.startswith(one + "::") for one in before if "::" not in one)

    before = set(before)
    config.hook.pytest_deselected(items=[item for item in items if not skipped(item)])
    items[:] = [item for item in items if skipped(item)]


def pytest_sessionfinish(session):
    config = session.config
    if getattr(config, "cache", None) is not None and not config.getoption("--skipped-before"):
        config.cache.set(SKIPPED_KEY, sorted(_skipped))
