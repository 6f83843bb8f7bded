"""Test setup: every output buffer starts as NaN, and without a GPU the Triton kernels run in
Triton's CPU interpreter (both must be set before flashjvp is imported)."""

import math
import os
import random
import re

import torch

os.environ.setdefault("FLASHJVP_POISON", "1")
# The kernel tests test flashjvp's own kernels; test_cudnn.py sets the switch to test the dispatch.
os.environ.setdefault("FLASHJVP_CUDNN", "0")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# An xdist worker's torch (and every process a test spawns: gloo ranks, subprocesses) uses its share
# of the cores, not all of them: on two cores with two workers, about 5-10% less time than
# oversubscribed threads.
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    _cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, _cores // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))))
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

import pytest  # noqa: E402

# Time budgets of test files, in seconds of test time (setup, call and teardown of every test of the
# file, summed over the xdist workers): a file over its budget fails the session, so that CI stays
# within its time. The budgets hold for the sampled run (below); a full-matrix run gets
# FULL_MATRIX_BUDGET_FACTOR times as much. Measured on two shared CPU cores: test_api_matrix.py
# about 50 s sampled, 120-180 s in full.
TIME_BUDGETS_S = {"tests/test_api_matrix.py": 150}
FULL_MATRIX_BUDGET_FACTOR = 3

# --------------------------------------------------------------------------- the sampled matrices
# The big parametrized matrices run a sample on every `make test`. Per test function listed here,
# the sample is the parametrizations whose ids match the function's pattern (regression cases kept
# in every run), then a greedy cover in which every value of every parameter occurs at least once
# (also of each item of a tuple or dict value: a shape's layout, a case's causal mode; a parameter
# with more values than the sample has cases, such as a list of distinct cases, only over seeds),
# then cases at random up to the fraction given. The random order comes from the seed FLASHJVP_TEST_SEED (or
# --matrix-seed; default 0), printed in the header and in the summary: the same seed selects the
# same cases, another seed other combinations (CI rotates it). FLASHJVP_TEST_FULL=1 (or
# --full-matrix) runs every parametrization. A case the sample leaves out is reported as deselected;
# a case named on the command line (test_x.py::test_f[id]) always runs. Parametrizations that are
# skipped here anyway (gpu, skip, skipif(True)) are left alone. Measured on two shared CPU cores
# (`-n 2`): the whole suite 1140-1370 s of test time in full (10-12 min), about 570 s sampled (5 min).
MATRICES = {  # "file::function": (fraction kept, regex of ids kept in every run or None)
    "tests/test_api_matrix.py::test_dense": (0.2, None),
    "tests/test_api_matrix.py::test_varlen": (0.2, "issue37"),
    "tests/test_api_matrix.py::test_sdpa": (0.3, None),
    "tests/test_backward.py::test_gradients_match_reference": (0.2, None),
    "tests/test_backward.py::test_aligned_rows_vector_path": (0.5, None),
    "tests/test_block_mask.py::test_forward_and_jvp": (0.5, None),
    "tests/test_block_mask.py::test_backward": (0.5, None),
    "tests/test_block_mask.py::test_second_order": (0.5, None),
    "tests/test_codegen.py::test_forward_loads_are_vectorized_when_aligned": (0.5, None),
    "tests/test_codegen.py::test_tma_path_descriptors": (0.5, None),
    "tests/test_codegen.py::test_block_mask_kernels_compile": (0.5, None),
    "tests/test_compile.py::test_opcheck": (0.5, None),
    "tests/test_compile.py::test_compiled_attention_jvp": (0.5, None),
    "tests/test_compile.py::test_patch_sdpa_compiled_block_training_step": (0.5, None),
    "tests/test_cudnn.py::test_plumbing_with_math_stand_in": (0.25, None),
    "tests/test_distributed.py::test_ulysses_matches_single_process": (0.5, None),
    "tests/test_forward.py::test_attention_jvp_matches_reference": (0.2, None),
    "tests/test_forward.py::test_attention_forward_matches_reference": (0.2, None),
    "tests/test_integrations.py::test_diffusers_context_parallel": (0.34, None),
    "tests/test_integrations.py::test_transformers_llama_jvp": (0.34, None),
    "tests/test_masks.py::test_forward_and_jvp": (0.2, None),
    "tests/test_masks.py::test_backward": (0.25, None),
    "tests/test_models.py::test_models_compiled_match_eager": (0.5, None),
    "tests/test_padding.py::test_forward_and_jvp": (0.2, None),
    "tests/test_padding.py::test_backward": (0.2, None),
    "tests/test_plan.py::test_single_jvp_level_direct_path": (0.34, None),
    "tests/test_sdpa.py::test_masks_run_the_kernels": (0.6, None),
    "tests/test_second_order.py::test_second_order_matches_double_differentiation": (0.2, None),
    "tests/test_split.py::test_split_matches_reference": (0.2, None),
    "tests/test_varlen.py::test_forward_and_jvp": (0.34, None),
    "tests/test_window.py::test_forward_and_jvp": (0.3, None),
    "tests/test_window.py::test_backward": (0.3, None),
}
# Matrices a test samples itself, through the matrix_sample fixture (one spawn runs all its cases).
INNER_MATRICES = {"tests/test_api_matrix.py::test_distributed": 0.3}  # "file::function": fraction kept


def _matrix_full(config) -> bool:
    return bool(config.getoption("full_matrix")) or os.environ.get("FLASHJVP_TEST_FULL", "0") not in ("", "0")


def _matrix_seed(config) -> str:
    return config.getoption("matrix_seed") or os.environ.get("FLASHJVP_TEST_SEED") or "0"


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def _value_key(value) -> str:
    return _ADDRESS.sub("", repr(value))  # the same in every process (xdist workers collect on their own)


def _features(value, path=()) -> set:
    """(path, value) of ``value`` and of every item of it (recursively into tuples and dicts)."""
    out = {(path, _value_key(value))}
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, tuple) else ()
    for k, v in items:
        out |= _features(v, (*path, k))
    return out


def _cover_sample(features: list[set], fraction: float, rng: random.Random, always=()) -> set[int]:
    """Indices of a sample of ``fraction`` of the cases whose ``features`` ((axis, value) pairs) are
    given: ``always`` and a random case, then greedily the case with the most values not yet in the
    sample (ties: the first in a random order) until every value of every axis with at most that many
    values (an axis a case lacks: the value "absent") is, then cases in that order."""
    order = list(range(len(features)))
    rng.shuffle(order)
    target = max(1, math.ceil(fraction * len(features)))
    axes = {a for f in features for a, _ in f}
    features = [f | {(a, "<absent>") for a in axes - {a for a, _ in f}} for f in features]
    values = {}
    for f in features:
        for axis, value in f:
            values.setdefault(axis, set()).add(value)
    kept = [i for i in order if i in set(always)] + [order[0]]  # the random case: every case runs at times
    need = {(a, v) for f in features for a, v in f if len(values[a]) <= target}
    need -= set().union(*(features[i] for i in kept))
    while need:
        pick = max(order, key=lambda i: len(features[i] & need))
        kept.append(pick)
        need -= features[pick]
    kept += [i for i in order if i not in kept][: max(0, target - len(set(kept)))]
    return set(kept)


def _will_skip(item) -> bool:
    if "gpu" in item.keywords and not torch.cuda.is_available():
        return True
    if any(True for _ in item.iter_markers("skip")):
        return True
    for mark in item.iter_markers("skipif"):
        conditions = mark.args or (mark.kwargs.get("condition"),)
        if any(c is True for c in conditions):
            return True
    return False


class _SampledMatrices:
    def __init__(self, config):
        self.full, self.seed = _matrix_full(config), _matrix_seed(config)
        self.named = {a.split("::")[-1] for a in config.args if "[" in a}  # ids asked for by name
        self.kept = self.total = 0

    def describe(self) -> str:
        if self.full:
            return "flashjvp matrices: full (every parametrization)"
        return (f"flashjvp matrices: sampled, seed {self.seed} (FLASHJVP_TEST_SEED={self.seed} reproduces this "
                "sample; FLASHJVP_TEST_FULL=1 runs every parametrization)")

    def pytest_report_header(self, config):
        return self.describe()

    @pytest.hookimpl(tryfirst=True)  # before -k and -m: the sample of a seed does not depend on them
    def pytest_collection_modifyitems(self, config, items):
        if self.full:
            return
        groups = {}
        for item in items:
            key = item.nodeid.split("[")[0]
            if key in MATRICES and hasattr(item, "callspec") and not _will_skip(item) and item.name not in self.named:
                groups.setdefault(key, []).append(item)
        dropped = set()
        for key, group in groups.items():
            fraction, pattern = MATRICES[key]
            features = [_features(item.callspec.params) for item in group]
            always = [i for i, item in enumerate(group) if pattern and re.search(pattern, item.callspec.id)]
            kept = _cover_sample(features, fraction, random.Random(f"{self.seed}:{key}"), always)
            dropped |= {id(item) for i, item in enumerate(group) if i not in kept}
            self.kept, self.total = self.kept + len(kept), self.total + len(group)
        if dropped:
            config.hook.pytest_deselected(items=[item for item in items if id(item) in dropped])
            items[:] = [item for item in items if id(item) not in dropped]
        if hasattr(config, "workeroutput"):  # an xdist worker: the controller reports (it collects nothing)
            deselected = sorted(item.nodeid for group in groups.values() for item in group if id(item) in dropped)
            config.workeroutput["flashjvp_matrices"] = dict(kept=self.kept, total=self.total, deselected=deselected)

    def pytest_terminal_summary(self, terminalreporter):
        counts = f": {self.kept} of {self.total} parametrizations of the sampled functions" if self.total else ""
        terminalreporter.write_line(self.describe() + counts)


class _SampledMatricesXdist:
    """Under xdist, the controller reports what the workers' (identical) samples deselected."""

    def __init__(self, sampled):
        self.sampled, self.done = sampled, False

    def pytest_testnodedown(self, node, error):
        out = getattr(node, "workeroutput", {}).get("flashjvp_matrices")
        if out is None or self.done:
            return
        self.done = True
        self.sampled.kept, self.sampled.total = out["kept"], out["total"]
        if out["deselected"]:  # node ids: the terminal reporter counts them (the items live on the workers)
            node.config.hook.pytest_deselected(items=out["deselected"])


class _TimeBudgets:
    def __init__(self):
        self.spent = {}

    def pytest_runtest_logreport(self, report):
        path = report.nodeid.split("::")[0]
        if path in TIME_BUDGETS_S:
            self.spent[path] = self.spent.get(path, 0.0) + report.duration

    def pytest_sessionfinish(self, session):
        factor = FULL_MATRIX_BUDGET_FACTOR if _matrix_full(session.config) else 1
        over = {p: t for p, t in self.spent.items() if t > TIME_BUDGETS_S[p] * factor}
        if over and not hasattr(session.config, "workerinput"):  # the controller sees every worker's reports
            reporter = session.config.pluginmanager.get_plugin("terminalreporter")
            for p, t in over.items():
                reporter.write_line(f"time budget: {p} took {t:.0f} s of test time, over its "
                                    f"{TIME_BUDGETS_S[p] * factor} s")
            session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_addoption(parser):
    group = parser.getgroup("flashjvp")
    group.addoption("--full-matrix", action="store_true", default=False,
                    help="run every parametrization of the sampled matrices (as FLASHJVP_TEST_FULL=1)")
    group.addoption("--matrix-seed", default=None,
                    help="seed of the sampled matrices (as FLASHJVP_TEST_SEED; default 0)")


def pytest_configure(config):
    config.pluginmanager.register(_TimeBudgets(), "flashjvp-time-budgets")
    sampled = _SampledMatrices(config)
    config.pluginmanager.register(sampled, "flashjvp-sampled-matrices")
    if config.pluginmanager.hasplugin("xdist"):
        config.pluginmanager.register(_SampledMatricesXdist(sampled), "flashjvp-sampled-matrices-xdist")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def matrix_sample(request):
    """``sample(cases, always=())``: the cases of a list of dicts that this run keeps, for a test that
    runs a matrix itself (INNER_MATRICES gives its fraction): every value of every key, the cases in
    ``always`` and random cases up to the fraction, by the run's seed; every case in full mode."""
    key = request.node.nodeid.split("[")[0]

    def sample(cases, always=()):
        if _matrix_full(request.config):
            return list(cases)
        features = [_features(c) for c in cases]
        rng = random.Random(f"{_matrix_seed(request.config)}:{request.node.nodeid}")
        kept = _cover_sample(features, INNER_MATRICES[key], rng, [i for i, c in enumerate(cases) if c in always])
        request.node.user_properties.append(("matrix_sample", f"{len(kept)} of {len(cases)} cases"))
        return [c for i, c in enumerate(cases) if i in kept]

    return sample


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
    from flashjvp._launch import PLANS

    PLANS.clear()
