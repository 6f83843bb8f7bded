"""benchmarks/bench_masks.py on the CPU: the pair counts behind the ideal ratios, FLOPs, the report
from synthetic rows, the time limit with a fake clock, the plan, the command line, and a --tiny
run end to end on the math reference path (the interpreter is too slow for a smoke test)."""

import json

import pytest
import torch

from benchmarks import bench_masks as bm
from benchmarks.bench_masks import Row


def _brute_pairs(nq, nk, causal=False, window=None, kv_len=None, bottom_right=False):
    """The rule of flashjvp.ref, written out on a dense (Nq, Nk) grid."""
    left, right = window or (-1, -1)
    if causal:
        right = 0
    off = nk - nq if (causal and bottom_right) else 0
    i = torch.arange(nq)[:, None] + off
    j = torch.arange(nk)[None, :]
    vis = torch.ones(nq, nk, dtype=torch.bool)
    if right >= 0:
        vis &= j <= i + right
    if left >= 0:
        vis &= j >= i - left
    if kv_len is not None:
        vis &= j < kv_len
    return int(vis.sum())


@pytest.mark.parametrize("nq,nk", [(7, 7), (5, 9), (9, 4)])
@pytest.mark.parametrize("causal,bottom_right", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("window", [None, (2, 1), (0, 0), (3, -1), (-1, 2)])
@pytest.mark.parametrize("kv_len", [None, 0, 3, 20])
def test_visible_pairs_matches_brute_force(nq, nk, causal, bottom_right, window, kv_len):
    got = bm.visible_pairs(nq, nk, causal=causal, window=window, kv_len=kv_len, bottom_right=bottom_right)
    assert got == _brute_pairs(nq, nk, causal, window, kv_len, bottom_right)


def test_ideal_ratios():
    lens = bm.VARLEN_LENGTHS
    b, m = len(lens), max(lens)
    assert bm.varlen_pairs(lens) == sum(n * n for n in lens)
    assert bm.padded_pairs(lens) == b * m * m
    assert bm.ideal_ratio(lens) == pytest.approx(sum(n * n for n in lens) / (b * m * m))
    assert bm.padded_pairs(lens, kv_lens=True) == sum(m * n for n in lens)  # padded queries still run
    # causal: n(n+1)/2 per sequence, against m(m+1)/2 per padded element
    assert bm.ideal_ratio(lens, causal=True) == pytest.approx(
        sum(n * (n + 1) / 2 for n in lens) / (b * m * (m + 1) / 2))
    assert bm.padded_pairs([4, 2], causal=True, kv_lens=True) == 10 + (1 + 2 + 2 + 2)
    # the sliding window's visible fraction: about (left + right + 1) / N far from the edges
    n, w = 32768, 1024
    frac = bm.visible_pairs(n, n, window=(w, w)) / n**2
    assert frac == pytest.approx((2 * w + 1) / n, rel=0.04) and frac < (2 * w + 1) / n
    assert bm.visible_pairs(n, n, window=(w, 0)) == bm.visible_pairs(n, n, causal=True, window=(w, -1))


def test_flops():
    fwd = bm.attention_flops(10, 3, 16, 32, "fwd")
    assert fwd == 2 * 3 * 10 * 48
    assert bm.attention_flops(10, 3, 16, 32, "fwd_jvp") == 3 * fwd
    assert bm.attention_flops(10, 3, 16, 32, "fwd_jvp", bm.Q_TANGENT) == 2 * fwd
    assert bm.attention_flops(10, 3, 16, 32, "fwd_bwd") == 3.5 * fwd
    with pytest.raises(ValueError):
        bm.attention_flops(10, 3, 16, 32, "bwd")


def _rows():
    return [
        Row("varlen", "causal=False", "B8 dims", "dense", "fwd", "q,k,v", "dense", 1.0, ms=4.0, tflops=100.0,
            peak_mib=12.0),
        Row("varlen", "causal=False", "B8 dims", "varlen", "fwd", "q,k,v", "dense", 0.5, ms=2.5, tflops=80.0,
            peak_mib=6.0),
        Row("varlen", "causal=True", "B8 dims", "varlen", "fwd", "q,k,v", "dense", 0.5, ms=1.0, tflops=80.0,
            peak_mib=6.0),
        Row("varlen", "causal=False", "B8 dims", "dense+kv_lens", "fwd", "q,k,v", "dense", 0.7,
            skip="OutOfMemoryError: CUDA out of memory"),
        Row("sdpa-mask", "", "B4 H32", "flashjvp.sdpa", "fwd_bwd", "", "flashjvp.sdpa", ms=2.0),
        Row("sdpa-mask", "", "B4 H32", "torch-efficient", "fwd_bwd", "", "flashjvp.sdpa", ms=3.0),
        Row("sdpa-mask", "", "B2 H24", "torch-efficient", "fwd_bwd", "", "flashjvp.sdpa", ms=5.0),
    ]


def test_ratios_and_report(tmp_path):
    rows = bm.compute_ratios(_rows())
    assert [r.ratio for r in rows] == [1.0, 0.625, None, None, 1.0, 1.5, None]  # no baseline: no ratio
    meta = {"gpu": "Fake GPU", "torch": "2.x", "triton": "3.x", "dtype": "bfloat16", "autotune": "1",
            "date": "2025-01-01T00:00:00+00:00", "command": "python -m benchmarks.bench_masks --quick",
            "wall_s": 12.0, "cases": {"sdpa-mask": {"title": "4. sdpa-mask title", "note": "a note"},
                                      "varlen": {"title": "1. varlen title"}}}
    paths = bm.write_report(rows, meta, tmp_path / "out")
    md = paths["md"].read_text()
    assert "Fake GPU" in md and "FLASHJVP_AUTOTUNE=1" in md and "`python -m benchmarks.bench_masks --quick`" in md
    assert md.index("## 4. sdpa-mask title") < md.index("## 1. varlen title")  # the order of meta["cases"]
    assert "a note" in md and "Partial" not in md
    assert "| causal=False | B8 dims | varlen | fwd | q,k,v | 2.500 | 80.0 | 6 | 0.625 | 0.500 |  |  |" in md
    assert "dense (baseline)" in md and "flashjvp.sdpa (baseline)" in md
    assert "| 1.500 |" in md and "OutOfMemoryError" in md
    data = json.loads(paths["json"].read_text())
    assert data["gpu"] == "Fake GPU" and data["cases"] == meta["cases"] and len(data["rows"]) == len(rows)
    assert Row(**data["rows"][1]) == rows[1]
    assert "Partial report" in bm.format_report([], {"partial": True})
    assert bm.format_report([], {}).startswith("# flashjvp masks benchmark: ?")


def _plan(n_items=6, per_set=2, fail_set=None):
    made = []

    def inputs(key):
        def make():
            made.append(key)
            if key == fail_set:
                raise RuntimeError("no memory for you")
            return {"key": key}
        return make

    plan = bm.Plan()
    for i in range(n_items):
        key = f"set{i // per_set}"
        plan.inputs[key] = inputs(key)
        row = Row("c", "", "d", f"v{i}", "fwd", "", "v0", None)
        plan.items.append(bm.Item(row, key, lambda x, i=i: ((lambda: x["key"]), []), flops=1e9))
    return plan, made


def test_run_time_limit_with_a_fake_clock():
    now = [0.0]

    def clock():
        return now[0]

    def timer(fn, leaves, quick):
        assert fn().startswith("set")
        now[0] += 10.0  # every measurement takes 10 s
        return 2.0, 1.0, 0.1

    plan, made = _plan()
    lines, checkpoints = [], []
    rows = bm.run(plan, time_limit=25.0, clock=clock, timer=timer, log=lines.append,
                  checkpoint=lambda rows: checkpoints.append(len(rows)))
    assert [r.ms for r in rows] == [2.0, 2.0, 2.0, None, None, None]  # started at 0, 10, 20 s
    assert all(r.skip == "time limit reached (--time-limit 25 s)" for r in rows[3:])
    assert rows[0].tflops == pytest.approx(0.5) and rows[1].ratio == 1.0
    assert made == ["set0", "set1"] and checkpoints == [2]  # set2 never made
    assert sum("time limit 25 s reached: skipping the last 3" in line for line in lines) == 1
    assert len(lines) == 3 + 1  # the skipped ones are not logged one by one

    # no limit: everything runs; a failing input set skips its items, the run goes on
    now[0] = 0.0
    plan, made = _plan(fail_set="set1")
    rows = bm.run(plan, clock=clock, timer=timer, log=lambda line: None)
    assert [r.skip is None for r in rows] == [True, True, False, False, True, True]
    assert rows[2].skip == "inputs: RuntimeError: no memory for you"
    assert made == ["set0", "set1", "set2"]


def test_run_records_exceptions_and_checks():
    plan, _ = _plan(n_items=3, per_set=3)
    plan.items[1].make = lambda x: (_ for _ in ()).throw(NotImplementedError("unsupported"))
    plan.items[2].check = lambda: "memory estimate 99 GiB"
    rows = bm.run(plan, timer=lambda fn, leaves, quick: (1.0, None, 0.0), log=lambda line: None)
    assert rows[0].ms == 1.0 and rows[0].peak_mib is None
    assert rows[1].skip == "NotImplementedError: unsupported" and rows[1].ms is None
    assert rows[2].skip == "memory estimate 99 GiB"


def test_plan_order_and_contents():
    plan = bm.make_plan(device="meta")  # nothing is allocated until run() makes an input set
    cases = list(dict.fromkeys(it.row.case for it in plan.items))
    assert cases == ["varlen", "window", "xattn-pad", "sdpa-mask"] == list(plan.cases)
    count = {c: sum(it.row.case == c for it in plan.items) for c in cases}
    assert count == {"varlen": 18, "window": 15, "xattn-pad": 9, "sdpa-mask": 16}
    assert [it.row.mode for it in plan.items[:6]] == ["fwd_jvp"] * 6  # the JVP first
    varlen = {(it.row.group, it.row.variant): it.row.ideal for it in plan.items if it.row.mode == "fwd"
              and it.row.case == "varlen"}
    assert varlen[("causal=False", "varlen")] == pytest.approx(bm.ideal_ratio(bm.VARLEN_LENGTHS))
    assert varlen[("causal=True", "dense")] == 1.0
    window = {it.row.variant: it.row.ideal for it in plan.items if it.row.case == "window"}
    assert window["full"] == 1.0 and window["causal"] == pytest.approx(0.5, abs=1e-4)
    assert window["window=(1024,1024)"] == pytest.approx(2049 / 32768, rel=0.04)
    xattn = [it.row for it in plan.items if it.row.case == "xattn-pad"]
    assert {r.tangents for r in xattn} == {"q", "q,k,v"} and {r.ideal for r in xattn} == {1.0, 0.5}
    sdpa = [it for it in plan.items if it.row.case == "sdpa-mask"]
    assert {it.row.variant for it in sdpa if it.row.mode == "fwd_jvp"} == {"flashjvp.sdpa", "torch-math"}
    assert all((it.check is not None) == (it.row.variant == "torch-math") for it in sdpa)


def test_key_padding_mask_and_math_check():
    mask = bm.key_padding_mask(4, 8, "cpu")
    assert mask.shape == (4, 1, 1, 8) and mask.dtype == torch.bool
    assert mask[:2].all() and mask[2:, ..., :4].all() and not mask[2:, ..., 4:].any()
    assert bm.math_memory_check(4, 32, 4096, 4096, "cpu") is None  # only estimated on CUDA


def test_cli(capsys):
    with pytest.raises(SystemExit) as e:
        bm.main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "--time-limit" in out and "--quick" in out and "1=varlen" in out and "--tiny" not in out
    assert bm.select_cases(None) == list(bm.CASE_ORDER)
    assert bm.select_cases(["3,1", "sdpa-mask"]) == ["window", "varlen", "sdpa-mask"]
    assert bm.select_cases(["2"]) == ["xattn-pad"]
    with pytest.raises(ValueError, match="unknown case"):
        bm.select_cases(["5"])
    with pytest.raises(SystemExit):
        bm.main(["--cases", "nope"])


def test_tiny_run_end_to_end(tmp_path, monkeypatch, capsys):
    """--tiny on the CPU: every case runs (flashjvp on its math reference path; PyTorch's fused
    backends have no CPU kernel and become skipped rows) and the report is written."""
    import flashjvp.interface

    monkeypatch.setattr(flashjvp.interface, "interpreting", lambda: False)
    out = tmp_path / "masks"
    assert bm.main(["--tiny", "--quick", "--time-limit", "0", "--out", str(out)]) == 0
    data = json.loads((out / "masks.json").read_text())
    rows = [Row(**r) for r in data["rows"]]
    assert len(rows) == 58 and data["command"].startswith("python -m benchmarks.bench_masks --tiny")
    measured = {(r.case, r.variant, r.mode, r.tangents) for r in rows if r.skip is None}
    for case, variant in [("varlen", "varlen"), ("varlen", "dense+kv_lens"), ("window", "window=(8,0)"),
                          ("xattn-pad", "kv_lens=16"), ("sdpa-mask", "flashjvp.sdpa"), ("sdpa-mask", "torch-math")]:
        assert any(c == case and v == variant for c, v, _, _ in measured), (case, variant)
    assert all(r.ratio == 1.0 for r in rows if r.variant == r.baseline and r.skip is None)
    assert all(r.skip for r in rows if r.variant in ("torch-efficient", "torch-cudnn"))
    md = (out / "masks.md").read_text()
    assert "## 1. varlen" in md and "## 4. sdpa-mask" in md
    assert "wrote" in capsys.readouterr().out
