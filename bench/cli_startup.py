"""How fast the command line answers: ``--help`` of every command, and what `import countlens` loads.

    .venv/bin/python bench/cli_startup.py               # writes bench/cli_startup.json

Each figure is the median wall time of 7 fresh processes (after one warm-up, so the OS file cache
is warm as it is for a user's second call). Also: the import time of `countlens` and of
`countlens.datasets` (``python -X importtime``, microseconds, cumulative) and whether either pulled
in torch or transformers — neither should: the subpackages load on first use.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

COMMANDS: tuple[str, ...] = (
    "",
    "eval",
    "discover",
    "finetune",
    "classify",
    "report",
    "data countingtricks",
    "toy train",
)


def wall(argv: list[str], repeats: int = 7) -> float:
    subprocess.run(argv, capture_output=True, check=True)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        subprocess.run(argv, capture_output=True, check=True)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def import_profile(module: str) -> dict:
    probe = f"import sys, {module}; print(int('torch' in sys.modules), int('transformers' in sys.modules))"
    out = subprocess.run([sys.executable, "-X", "importtime", "-c", probe], capture_output=True, text=True, check=True)
    rows = [line.split("|") for line in out.stderr.splitlines() if line.startswith("import time:") and "|" in line]
    total = next(int(r[1]) for r in rows if r[2].strip() == module)
    torch_loaded, transformers_loaded = (bool(int(x)) for x in out.stdout.split())
    return {"cumulative_us": total, "loads_torch": torch_loaded, "loads_transformers": transformers_loaded}


def main() -> dict:
    exe = str(Path(sys.executable).with_name("countlens"))
    helps = {(c or "countlens") + " --help": round(wall([exe, *c.split(), "--help"]), 3) for c in COMMANDS}
    result = {
        "help_s": helps,
        "slowest_help_s": max(helps.values()),
        "goal_s": 1.0,
        "import": {m: import_profile(m) for m in ("countlens", "countlens.datasets", "countlens.cli")},
    }
    Path(__file__).with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    print(json.dumps(main(), indent=2))
