"""Writes .exp/fwd_rev.py for d64.py: src/flashjvp/_fwd.py with causal row blocks launched
heaviest first (pid_m reversed when CAUSAL). Run from the repo root before d64.py."""
from pathlib import Path

src = Path("src/flashjvp/_fwd.py").read_text()
old = "    pid_m = tl.program_id(0)\n    h = tl.program_id(1)\n"
assert src.count(old) == 1
new = old.replace("\n", "\n    if CAUSAL:\n        pid_m = tl.num_programs(0) - 1 - pid_m\n", 1)
Path(".exp").mkdir(exist_ok=True)
Path(".exp/fwd_rev.py").write_text(src.replace(old, new))
