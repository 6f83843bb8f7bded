"""scripts/tests_report.py: the per-file table of a GPU test run, from pytest's own JUnit XML."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_report_counts_every_outcome_per_file(tmp_path):
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "test_a.py").write_text(
        "import pytest\n"
        "def test_pass(): pass\n"
        "def test_fail(): assert False\n"
        "@pytest.mark.skip(reason='x')\n"
        "def test_skip(): pass\n"
        "@pytest.fixture\n"
        "def broken(): raise RuntimeError\n"
        "def test_error(broken): pass\n")
    (tests / "test_b.py").write_text("class TestB:\n    def test_one(self): pass\n    def test_two(self): pass\n")
    xml = tmp_path / "run.xml"
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tests), f"--junitxml={xml}",
                    "--rootdir", str(tmp_path), "-c", "/dev/null"], cwd=tmp_path, capture_output=True)
    meta = tmp_path / "gpu.txt"
    meta.write_text("NVIDIA H100, torch 2.11.0, triton 3.6.0\n")
    out = tmp_path / "tests.md"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "tests_report.py"), str(xml), "--title", "fixed tiles",
                    "--meta", str(meta), "--out", str(out)], check=True)
    text = out.read_text()
    assert "NVIDIA H100, torch 2.11.0" in text and "## fixed tiles" in text
    rows = {line.split(" | ")[0].lstrip("| "): line for line in text.splitlines() if line.startswith("| ")}
    assert rows["tests/test_a.py"].startswith("| tests/test_a.py | 1 | 1 | 1 | 1 |"), rows
    assert rows["tests/test_b.py"].startswith("| tests/test_b.py | 2 | 0 | 0 | 0 |"), rows
    assert rows["**all**"].startswith("| **all** | **3** | **1** | **1** | **1** |"), rows
