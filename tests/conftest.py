"""Test setup: every output buffer starts as NaN, and without a GPU the Triton kernels run in
Triton's CPU interpreter (both must be set before flashjvp is imported)."""

import os

import torch

os.environ.setdefault("FLASHJVP_POISON", "1")
# The kernel tests test flashjvp's own kernels; test_cudnn.py sets the switch to test the dispatch.
os.environ.setdefault("FLASHJVP_CUDNN", "0")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

# Time budgets of test files, in seconds of test time (setup, call and teardown of every test of the
# file, summed over the xdist workers): a file over its budget fails the session, so that CI stays
# within its time. Measured on two shared CPU cores: test_api_matrix.py about 150 s.
TIME_BUDGETS_S = {"tests/test_api_matrix.py": 300}


class _TimeBudgets:
    def __init__(self):
        self.spent = {}

    def pytest_runtest_logreport(self, report):
        path = report.nodeid.split("::")[0]
        if path in TIME_BUDGETS_S:
            self.spent[path] = self.spent.get(path, 0.0) + report.duration

    def pytest_sessionfinish(self, session):
        over = {p: t for p, t in self.spent.items() if t > TIME_BUDGETS_S[p]}
        if over and not hasattr(session.config, "workerinput"):  # the controller sees every worker's reports
            reporter = session.config.pluginmanager.get_plugin("terminalreporter")
            for p, t in over.items():
                reporter.write_line(f"time budget: {p} took {t:.0f} s of test time, over its {TIME_BUDGETS_S[p]} s")
            session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_configure(config):
    config.pluginmanager.register(_TimeBudgets(), "flashjvp-time-budgets")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def seed(request):
    """A fresh, reproducible seed per test (derived from the test id)."""
    s = sum(map(ord, request.node.nodeid)) % (2**31)
    torch.manual_seed(s)
    return s


@pytest.fixture
def fresh_sdpa_warnings():
    """Each test starts with no flashjvp.sdpa call site warned about yet."""
    import sys

    warned = sys.modules["flashjvp.sdpa"]._warned
    warned.clear()
    yield
    warned.clear()


@pytest.fixture(autouse=True)
def fresh_plans():
    """Each test starts without launch plans: a plan made by an earlier test would bypass what a
    test patches or forces (the Autotuner, a tile, the cuDNN policy)."""
    from flashjvp import _bwd, _fwd, _plan

    for module in (_fwd, _bwd, _plan):
        module._PLANS.clear()
