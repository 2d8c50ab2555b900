"""How long a server takes to start, on the CPU: from the command to the first 200 on
/health, each run in fresh processes, the embedded default model unless --model.

    python bench/server_start.py [--model PATH] [--runs 3] [--json bench/results/server_start.json]

Rows, alternated run by run so that a drifting machine shifts them alike:
- ``atom serve``: the console script, as a user starts it;
- ``python -c`` through ``server_process``, as the tests and the serving benches start it;
- transformers (the peer): one process that imports it and loads the same model (fp32) and
  tokenizer, the least a server built on it would do;
- the floor: one process importing torch and transformers' tokenizer and exiting. Both of
  ATOM's processes pay at least that; on two or more cores they can pay it side by side.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import ROOT, markdown_table, write_json  # noqa: E402

from atom_core.entrypoints.server_process import ServerProcess  # noqa: E402
from atom_core.loader import embedded_model_path  # noqa: E402

FLOOR = "import torch\nfrom transformers import AutoTokenizer\n"
PEER = """
import sys, torch
from pathlib import Path
from transformers import AutoModelForCausalLM, AutoTokenizer
p = Path(sys.argv[1])
kw = {"gguf_file": p.name} if p.suffix == ".gguf" else {}
where = str(p.parent) if kw else str(p)
AutoModelForCausalLM.from_pretrained(where, dtype=torch.float32, **kw)
AutoTokenizer.from_pretrained(where, **kw)
"""


def serve_seconds(model: Path | None, command: list[str] | None) -> float:
    """Wall seconds from the command to the first 200 on /health."""
    t = time.monotonic()
    server = ServerProcess(model, command=command).wait_ready()
    took = time.monotonic() - t
    server.stop()
    return took


def process_seconds(script: str, *args: str) -> float:
    t = time.monotonic()
    subprocess.run([sys.executable, "-c", script, *args], check=True, cwd=ROOT,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.monotonic() - t


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=None)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "server_start.json")
    args = p.parse_args()
    atom = shutil.which("atom", path=os.path.dirname(sys.executable)) or shutil.which("atom")
    if atom is None:
        sys.exit("server_start: no `atom` command next to this Python (pip install -e .)")
    model = args.model or embedded_model_path()
    rows: dict[str, list[float]] = {
        "ATOM: `atom serve` to /health 200": [],
        "ATOM: `python -c` (server_process) to /health 200": [],
        "transformers: one process loading model + tokenizer": [],
        "floor: a process importing torch and transformers' tokenizer": [],
    }
    names = list(rows)
    for _ in range(args.runs):
        rows[names[0]].append(serve_seconds(args.model, [atom, "serve"]))
        rows[names[1]].append(serve_seconds(args.model, None))
        rows[names[2]].append(process_seconds(PEER, str(model)))
        rows[names[3]].append(process_seconds(FLOOR))
    print(f"{model.name}, {args.runs} runs, {os.cpu_count()} CPUs, seconds (min / median)")
    table = [[name, f"{min(t):.2f}", f"{statistics.median(t):.2f}"]
             for name, t in rows.items()]
    print(markdown_table(["start", "min", "median"], table))
    write_json(args.json, {"model": str(model), "runs": rows})


if __name__ == "__main__":
    main()
