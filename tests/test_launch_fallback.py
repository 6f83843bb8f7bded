"""The launch-plan fallback (``_launch.launcher_interface``): a plan (``Launcher``) calls Triton's private
``CompiledKernel.run`` positionally, so it is made only where that launcher is the one Launcher knows
(Triton 3.6's or 3.9's calling convention); a missing or differently shaped one leaves every call on the JIT
launch. The decision is checked on stand-ins for the compiled kernel (the interpreter returns none), its
wiring in ``plan_tuned`` likewise, and calls with the fallback forced against the float64 reference (on the
GPU, where plans are otherwise made, no plan may launch)."""

from types import SimpleNamespace

import pytest
import torch

import flashjvp
from flashjvp import _launch
from helpers import assert_close, check_jvp, f64, grad_refs, make_qkv

needs_knobs = pytest.mark.skipif(_launch._knobs is None, reason="Triton before 3.4: no launcher interface")


class Launcher36:
    """Triton 3.6's CudaLauncher: metadata, hooks and the kernel's arguments all in ``*args``."""

    def __call__(self, gridX, gridY, gridZ, stream, function, *args):
        pass


class Launcher39:
    """Triton 3.9's CudaLauncher: the metadata and hooks named."""

    def __call__(self, gridX, gridY, gridZ, stream, function, kernel_metadata, launch_metadata,
                 launch_enter_hook, launch_exit_hook, *args):
        pass


class LauncherOtherNames:
    """A backend's launcher naming the four after ``function`` its own way, with an optional keyword."""

    def __call__(self, gridX, gridY, gridZ, stream, function, packed_metadata, launch_metadata, enter_hook,
                 exit_hook, *args, sync=False):
        pass


class LauncherReordered:
    def __call__(self, stream, gridX, gridY, gridZ, function, *args):
        pass


class LauncherExtraParameter:
    """One more positional parameter before the kernel's arguments: they would land one slot off."""

    def __call__(self, gridX, gridY, gridZ, stream, function, cluster, *args):
        pass


class LauncherFixedArity:
    def __call__(self, gridX, gridY, gridZ, stream, function, kernel_metadata, launch_metadata,
                 launch_enter_hook, launch_exit_hook, args):
        pass


class LauncherRequiredKeyword:
    def __call__(self, gridX, gridY, gridZ, stream, function, *args, scratch):
        pass


def _plain_function_launcher(gridX, gridY, gridZ, stream, function, *args):
    pass


def _compiled(launcher, **drop):
    """A stand-in for the ``CompiledKernel`` a JIT launch returns on a GPU (``launcher`` as its ``run``), less
    the attributes named in ``drop``."""
    attrs = dict(run=launcher, function=object(), packed_metadata=(), launch_metadata=lambda *a: None)
    return SimpleNamespace(**{k: v for k, v in attrs.items() if k not in drop})


@needs_knobs
@pytest.mark.parametrize("cls", [Launcher36, Launcher39, LauncherOtherNames])
def test_known_launchers_get_plans(cls):
    assert _launch.launcher_interface(_compiled(cls()))


@pytest.mark.parametrize(
    "compiled",
    [
        pytest.param(None, id="interpreter"),
        pytest.param(_compiled(Launcher39(), run=True), id="no-run"),
        pytest.param(_compiled(Launcher39(), function=True), id="no-function"),
        pytest.param(_compiled(Launcher39(), packed_metadata=True), id="no-packed-metadata"),
        pytest.param(_compiled(Launcher39(), launch_metadata=True), id="no-launch-metadata"),
        pytest.param(_compiled(LauncherReordered()), id="reordered"),
        pytest.param(_compiled(LauncherExtraParameter()), id="extra-parameter"),
        pytest.param(_compiled(LauncherFixedArity()), id="no-varargs"),
        pytest.param(_compiled(LauncherRequiredKeyword()), id="required-keyword"),
        pytest.param(_compiled(_plain_function_launcher), id="plain-function"),
        pytest.param(_compiled(len), id="builtin"),
    ],
)
def test_other_launchers_fall_back(compiled):
    assert not _launch.launcher_interface(compiled)


@needs_knobs
@pytest.mark.parametrize("module, name", [("triton.backends.nvidia.driver", "CudaLauncher"),
                                          ("triton.backends.amd.driver", "HIPLauncher")])
def test_installed_triton_launchers_are_known(module, name):
    """The launcher classes of the installed Triton (what ``CompiledKernel.run`` is on a GPU; importable
    without one) take Launcher's call: a Triton that changed them would lose the plans silently."""
    assert _launch._known_launcher(getattr(pytest.importorskip(module), name))


def _fake_tuned_launch(monkeypatch, compiled):
    """``_launch._tuned_launch`` returning ``compiled`` as what the JIT launch returned, for a kernel of
    arguments (A, B, n, BLOCK) whose heuristics set nothing."""
    config = {"BLOCK": 16}
    jit = SimpleNamespace(arg_names=["A", "B", "n", "BLOCK"])
    monkeypatch.setattr(_launch, "_tuned_launch", lambda kernel, grid, args, kwargs: (config, {}, compiled, jit))
    return SimpleNamespace(base_fn=_fake_tuned_launch)


@needs_knobs
def test_plan_tuned_makes_a_plan_for_a_known_launcher(monkeypatch):
    compiled = _compiled(Launcher39())
    kernel = _fake_tuned_launch(monkeypatch, compiled)
    config, plan = _launch.plan_tuned(kernel, lambda meta: (meta["n"] // meta["BLOCK"], 2), 2, "a", "b", n=64)
    assert config == {"BLOCK": 16}
    assert isinstance(plan, _launch.Launcher)
    assert plan.kernel is compiled and plan.grid == (4, 2, 1) and plan.tail == (64, 16)


@pytest.mark.parametrize("run", [LauncherExtraParameter(), _plain_function_launcher], ids=["extra-parameter",
                                                                                          "plain-function"])
def test_plan_tuned_falls_back_for_another_launcher(monkeypatch, run):
    kernel = _fake_tuned_launch(monkeypatch, _compiled(run))
    config, plan = _launch.plan_tuned(kernel, (1,), 2, "a", "b", n=64)
    assert config == {"BLOCK": 16} and plan is None


@pytest.fixture
def no_launcher(monkeypatch):
    """Every compiled kernel counts as having an unknown launcher, and a plan launch fails the test."""
    monkeypatch.setattr(_launch, "launcher_interface", lambda compiled: False)

    def launched(self, *tensors):
        raise AssertionError(f"{self.name} launched through a plan despite the fallback")

    monkeypatch.setattr(_launch.Launcher, "__call__", launched)


@pytest.mark.parametrize("causal", [False, True])
def test_forced_fallback_matches_the_reference(no_launcher, causal):
    """Three calls of one signature (on a GPU the second and third would launch through plans): the
    forward, forward+JVP and backward on the JIT launch, against the float64 reference."""
    dtype = torch.float32
    for _ in range(3):
        q, k, v, tq, tk, tv = make_qkv(1, 2, 2, 33, 40, 16, 16, "bhnd", dtype, kinds=("contiguous",))
        check_jvp(q, k, v, tq, tk, tv, dtype, causal=causal)
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]
        o = flashjvp.attention(*leaves, causal=causal)
        truth = flashjvp.attention_ref(*f64((q, k, v)), causal=causal)
        assert_close("o", o, truth, flashjvp.attention_ref(q, k, v, causal=causal), dtype)
        do = torch.randn_like(o)
        g64, g_lp = grad_refs(q, k, v, do, causal=causal)
        for name, g, ref, ref_lp in zip(("dq", "dk", "dv"), torch.autograd.grad(o, leaves, do), g64, g_lp):
            assert_close(name, g, ref, ref_lp, dtype)


@pytest.mark.gpu
def test_installed_triton_has_the_known_launcher():
    """On the GPU the installed Triton's compiled kernels must get plans: a Triton whose launcher changed
    would otherwise lose the fast path silently."""
    import triton
    import triton.language as tl

    @triton.jit
    def copy(src, dst, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(dst + offs, tl.load(src + offs, mask=offs < n), mask=offs < n)

    x = torch.randn(100, device="cuda")
    y = torch.empty_like(x)
    compiled = copy[(2,)](x, y, x.numel(), BLOCK=64)
    torch.testing.assert_close(y, x)
    assert _launch.launcher_interface(compiled), type(compiled.run)
