"""How long a GGUF takes to load, on the CPU: ATOM with an empty header cache and with its
entry, beside transformers on the same file, each in a fresh process.

    python bench/gguf_load.py [--model FILE.gguf] [--runs 2] [--json bench/results/gguf_load.json]

Without --model: the embedded default (SmolLM2-135M-Instruct, Q4_1). Each row is the wall
time of one call in a new Python process, timed from after its imports:
- ATOM, cold: ``load_model`` (config, weights dequantized to fp32, tokenizer) with
  ``ATOM_CACHE_DIR`` pointing at an empty directory, so the header is parsed;
- ATOM, cached: the same with the entry the cold run wrote;
- transformers: ``AutoModelForCausalLM.from_pretrained(gguf_file=...)`` (fp32) plus
  ``AutoTokenizer.from_pretrained(gguf_file=...)``, the peer's way to the same objects.
The floor beside them is reading the file once (from the page cache).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import ROOT, markdown_table, write_json  # noqa: E402

ATOM = """
import sys, time, torch
from atom_core.config import Config
from atom_core.loader import load_model
t = time.perf_counter()
load_model(Config.from_kwargs(model=sys.argv[1]), "cpu", torch.float32)
print(time.perf_counter() - t)
"""

HF = """
import sys, time, torch
from pathlib import Path
from transformers import AutoModelForCausalLM, AutoTokenizer
p = Path(sys.argv[1])
t = time.perf_counter()
AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=torch.float32)
AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
print(time.perf_counter() - t)
"""


def timed(script: str, path: Path, env: dict[str, str] | None = None) -> float:
    out = subprocess.run([sys.executable, "-c", script, str(path)], capture_output=True,
                         text=True, env=env, cwd=ROOT, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def read_seconds(path: Path) -> float:
    path.read_bytes()  # into the page cache
    t = time.perf_counter()
    path.read_bytes()
    return time.perf_counter() - t


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=None)
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "gguf_load.json")
    args = p.parse_args()
    if args.model is None:
        from atom_core.loader import embedded_model_path

        args.model = embedded_model_path()
    rows: dict[str, list[float]] = {"ATOM, cold (header parsed)": [],
                                    "ATOM, cached header": [],
                                    "transformers (model + tokenizer)": []}
    for _ in range(args.runs):
        with tempfile.TemporaryDirectory() as cache:
            env = {**os.environ, "ATOM_CACHE_DIR": cache}
            rows["ATOM, cold (header parsed)"].append(timed(ATOM, args.model, env))
            rows["ATOM, cached header"].append(timed(ATOM, args.model, env))
        rows["transformers (model + tokenizer)"].append(timed(HF, args.model))
    floor = read_seconds(args.model)
    size = args.model.stat().st_size
    print(f"{args.model.name} ({size / 1e6:.1f} MB), {args.runs} runs, seconds (min / median)")
    table = [[name, f"{min(times):.2f}", f"{statistics.median(times):.2f}"]
             for name, times in rows.items()]
    table.append(["floor: reading the file from the page cache", f"{floor:.3f}", "-"])
    print(markdown_table(["load", "min", "median"], table))
    write_json(args.json, {"model": str(args.model), "bytes": size, "runs": rows,
                           "read_seconds": floor})


if __name__ == "__main__":
    main()
