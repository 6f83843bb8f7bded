"""A GPU test run as a per-file table: passed, failed, errors, skipped and seconds of every test file,
from pytest's JUnit XML (``--junitxml``), with the machine, versions, command and date on top.

    python scripts/tests_report.py RUN.xml [RUN2.xml ...] --title "fixed tiles" --meta gpu.txt --out tests.md

Several XML files (the fixed-tile run, the tuned-tile sample) become one section each.
"""

from __future__ import annotations

import argparse
import datetime
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

COLUMNS = ("passed", "failed", "errors", "skipped")


def per_file(xml_path: Path) -> dict[str, dict[str, float]]:
    """{test file: {passed, failed, errors, skipped, seconds}} of one JUnit XML report."""
    counts: dict[str, dict[str, float]] = defaultdict(lambda: dict.fromkeys((*COLUMNS, "seconds"), 0))
    for case in ET.parse(xml_path).getroot().iter("testcase"):
        path = case.get("file") or _module_path(case.get("classname", ""))
        row = counts[path]
        row["seconds"] += float(case.get("time") or 0.0)
        kinds = {child.tag for child in case}
        row["failed" if "failure" in kinds else "errors" if "error" in kinds else
            "skipped" if "skipped" in kinds else "passed"] += 1
    return dict(sorted(counts.items()))


def _module_path(classname: str) -> str:
    """``tests.test_x`` or ``tests.test_x.TestClass`` (xunit2's classname) as ``tests/test_x.py``."""
    parts = classname.split(".")
    last = max((i for i, part in enumerate(parts) if part.startswith("test_")), default=len(parts) - 1)
    return "/".join(parts[: last + 1]) + ".py"


def table(counts: dict[str, dict[str, float]]) -> list[str]:
    lines = ["| file | " + " | ".join(COLUMNS) + " | seconds |", "|---" * (len(COLUMNS) + 2) + "|"]
    total = dict.fromkeys((*COLUMNS, "seconds"), 0)
    for path, row in counts.items():
        lines.append(f"| {path} | " + " | ".join(str(int(row[c])) for c in COLUMNS) + f" | {row['seconds']:.0f} |")
        for c in total:
            total[c] += row[c]
    lines.append("| **all** | " + " | ".join(f"**{int(total[c])}**" for c in COLUMNS) + f" | {total['seconds']:.0f} |")
    return lines


def report(xmls: list[Path], titles: list[str], meta: str, command: str, date: str) -> str:
    out = ["# GPU test run", "", meta.strip(), "", f"{date}; `{command}`", ""]
    for xml_path, title in zip(xmls, titles):
        out += [f"## {title}", "", *table(per_file(xml_path)), ""]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("xml", nargs="+", type=Path)
    ap.add_argument("--title", action="append", default=[], help="one per XML file (default: its name)")
    ap.add_argument("--meta", type=Path, help="a file with the machine and versions (nvidia-smi, torch, triton)")
    ap.add_argument("--command", default="bash scripts/gpu_suite.sh tests,tuned")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    titles = args.title + [p.stem for p in args.xml[len(args.title):]]
    meta = args.meta.read_text() if args.meta else ""
    args.out.write_text(report(args.xml, titles, meta, args.command, datetime.date.today().isoformat()) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
