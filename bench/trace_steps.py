"""Where an engine trace's time goes, step by step: a summary of one torch profiler trace.

Reads a Chrome-trace JSON (gzip or plain) that the engine's profiler wrote
(``{torch_profiler_dir}/rank_0/*.json.gz``, see atom_core/engine/profiler.py) and prints
markdown tables:

    python bench/trace_steps.py TRACE.json.gz [--top 15] [--json out.json]

The engine wraps each forward in a ``prefill[bs=.. tok=..]`` or ``decode[bs=.. tok=..]``
range (atom_core/engine/annotations.py); nested ranges inside an outer step range are not
steps of their own. A kernel (``cat`` "kernel") belongs to the step whose range encloses
its launch, the runtime or driver call with the same ``args["correlation"]``; the kernels
of a CUDA-graph replay all carry their ``cudaGraphLaunch``'s correlation. Printed:

1. the window (the first step's start to the later of the last step's end and the end of
   the last kernel a step launched), GPU busy time (the union of kernel intervals on every
   stream, clipped to the window), the idle fraction, and the steps of each kind;
2. per step kind and size (decode by batch size in powers of two, prefill by tokens:
   <=256, <=384, <=512, <=768, <=1024, <=2048, <=4096, <=16384, more): steps, mean CPU
   time of the range, mean GPU time of its kernels (their sum), mean GPU span (first
   kernel start to last kernel end) and mean
   host gap (this range's end to the next one's start: scheduling and output processing);
3. the top kernels by GPU time within prefill steps and within decode steps;
4. idle gaps: GPU idle time between consecutive kernels where the gap exceeds 50 us, by
   the kind of the step that launched the kernel after the gap.

Memory copies and sets are not kernels here. A CPU trace has no kernels: only the CPU
columns are printed. ``--json`` writes the numbers, stamped as every bench's are.
"""

from __future__ import annotations

import argparse
import gc
import gzip
import json
import re
import sys
from bisect import bisect_right
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from common import markdown_table, write_json  # noqa: E402

LABEL = re.compile(r"(prefill|decode)\[bs=(\d+) tok=(\d+)")
PREFILL_BUCKETS = (256, 384, 512, 768, 1024, 2048, 4096, 16384)
GAP_US = 50.0
KINDS = ("prefill", "decode")


@dataclass
class Step:
    start: float
    end: float
    kind: str
    size: str
    order: int  # sorts sizes within a kind


@dataclass
class Kernel:
    start: float
    end: float
    name: str
    step: int  # index into the steps, -1 where no step range encloses the launch


def size_bucket(kind: str, bs: int, tok: int) -> tuple[str, int]:
    """(label, sort key) of a step's size: decode by batch size (1, 2, 3-4, 5-8, ...),
    prefill by tokens."""
    if kind == "decode":
        top = 1 << (bs - 1).bit_length()
        return (f"bs={bs}" if top <= 2 else f"bs={top // 2 + 1}-{top}"), top
    for limit in PREFILL_BUCKETS:
        if tok <= limit:
            return f"tok<={limit}", limit
    return f"tok>{PREFILL_BUCKETS[-1]}", PREFILL_BUCKETS[-1] + 1


def load_trace(path: str | Path) -> dict:
    """The trace's JSON (gzip or plain); a bare list of events is wrapped as traceEvents."""
    with open(path, "rb") as f:
        opener = gzip.open if f.read(2) == b"\x1f\x8b" else open
    with opener(path, "rb") as f:
        data = json.load(f)
    return data if isinstance(data, dict) else {"traceEvents": data}


def _span(e: dict) -> tuple[float, float] | None:
    try:
        start = float(e["ts"])
        return start, start + float(e.get("dur", 0.0))
    except (KeyError, TypeError, ValueError):
        return None


def find_steps(events: list[dict]) -> list[Step]:
    """The outermost step ranges on the host, by start."""
    found = []
    for e in events:
        m = LABEL.match(str(e.get("name", "")))
        span = _span(e) if m and e.get("ph") == "X" else None
        # The GPU timeline repeats each range as "gpu_user_annotation": not a host step.
        if span is None or e.get("cat") == "gpu_user_annotation":
            continue
        kind = m.group(1)
        size, order = size_bucket(kind, int(m.group(2)), int(m.group(3)))
        found.append(Step(span[0], span[1], kind, size, order))
    found.sort(key=lambda s: (s.start, -s.end))
    steps: list[Step] = []
    for s in found:
        if not steps or s.end > steps[-1].end:  # one inside the last kept step is nested
            steps.append(s)
    return steps


def find_kernels(events: list[dict], steps: list[Step]) -> list[Kernel]:
    """Every kernel, by start, with the step whose range encloses its launch."""
    launches: dict[Any, float] = {}
    for e in events:
        cat = str(e.get("cat", ""))
        corr = (e.get("args") or {}).get("correlation")
        if corr is not None and cat.endswith(("_runtime", "_driver")) and "ts" in e:
            launches[corr] = float(e["ts"])
    starts = [s.start for s in steps]

    def enclosing(ts: float | None) -> int:
        i = bisect_right(starts, ts) - 1 if ts is not None else -1
        return i if i >= 0 and ts <= steps[i].end else -1

    kernels = []
    for e in events:
        span = _span(e) if e.get("cat") == "kernel" else None
        if span is not None:
            launch = launches.get((e.get("args") or {}).get("correlation"))
            kernels.append(Kernel(span[0], span[1], str(e.get("name", "")), enclosing(launch)))
    kernels.sort(key=lambda k: k.start)
    return kernels


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def step_groups(steps: list[Step], kernels: list[Kernel]) -> list[dict]:
    """Per (kind, size): steps and mean CPU, GPU, GPU span and host gap, in ms (the GPU's
    only where there are kernels)."""
    gpu = [0.0] * len(steps)
    first = [float("inf")] * len(steps)
    last = [float("-inf")] * len(steps)
    for k in kernels:
        if k.step >= 0:
            gpu[k.step] += k.end - k.start
            first[k.step] = min(first[k.step], k.start)
            last[k.step] = max(last[k.step], k.end)
    groups: dict[tuple, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for i, s in enumerate(steps):
        g = groups[(KINDS.index(s.kind), s.order, s.kind, s.size)]
        g["cpu"].append(s.end - s.start)
        g["gpu"].append(gpu[i])
        g["span"].append(last[i] - first[i] if last[i] >= first[i] else 0.0)
        if i + 1 < len(steps):
            g["gap"].append(steps[i + 1].start - s.end)
    rows = []
    for (_, _, kind, size), g in sorted(groups.items()):
        keys = ("cpu", "gpu", "span", "gap") if kernels else ("cpu", "gap")
        means = {f"{key}_ms": _mean([v / 1e3 for v in g[key]]) for key in keys}
        rows.append({"kind": kind, "size": size, "steps": len(g["cpu"]), **means})
    return rows


def top_kernels(steps: list[Step], kernels: list[Kernel], kind: str, n: int) -> list[dict]:
    """The ``n`` kernels with the most GPU time within steps of ``kind``."""
    total: dict[str, float] = defaultdict(float)
    count: Counter[str] = Counter()
    for k in kernels:
        if k.step >= 0 and steps[k.step].kind == kind:
            total[k.name] += k.end - k.start
            count[k.name] += 1
    whole = sum(total.values())
    ranked = sorted(total.items(), key=lambda kv: -kv[1])[:n]
    # A "|" in a C++ name (operator||) would split the markdown cell.
    return [{"kernel": name[:60].replace("|", "/"), "count": count[name], "total_ms": t / 1e3,
             "share": t / whole} for name, t in ranked]


def gpu_timeline(steps: list[Step], kernels: list[Kernel]) -> dict:
    """The window, the GPU's busy time in it, and its idle gaps over ``GAP_US``."""
    w0 = steps[0].start
    w1 = max([steps[-1].end] + [k.end for k in kernels if k.step >= 0])
    busy, seen = 0.0, 0
    gaps: dict[str, float] = defaultdict(float)
    gap_count: Counter[str] = Counter()
    cur_start = cur_end = None
    for k in kernels:  # merge the intervals, by start, into their union
        if k.end <= w0 or k.start >= w1:
            continue
        seen += 1
        if cur_end is not None and k.start <= cur_end:
            cur_end = max(cur_end, k.end)
            continue
        if cur_end is not None:
            busy += min(cur_end, w1) - max(cur_start, w0)
            if k.start - cur_end > GAP_US:
                where = steps[k.step].kind if k.step >= 0 else "outside steps"
                gaps[where] += k.start - cur_end
                gap_count[where] += 1
        cur_start, cur_end = k.start, k.end
    if cur_end is not None:
        busy += min(cur_end, w1) - max(cur_start, w0)
    window = w1 - w0
    return {"window_ms": window / 1e3, "window_kernels": seen, "gpu_busy_ms": busy / 1e3,
            "gpu_idle_fraction": 1 - busy / window if window > 0 else 0.0,
            "idle_gaps": {where: {"gaps": gap_count[where], "ms": t / 1e3}
                          for where, t in gaps.items()}}


def summarize(events: list[dict], top: int = 15) -> dict:
    """The numbers the report prints; raises ValueError for a trace with no step ranges."""
    steps = find_steps(events)
    if not steps:
        raise ValueError("no prefill[...] or decode[...] step ranges in this trace")
    kernels = find_kernels(events, steps)
    out: dict[str, Any] = {
        "steps": {kind: sum(s.kind == kind for s in steps) for kind in KINDS},
        "window_ms": (steps[-1].end - steps[0].start) / 1e3,
        "groups": step_groups(steps, kernels),
        "kernels": len(kernels),
    }
    if kernels:
        out.update(gpu_timeline(steps, kernels))
        out["top_kernels"] = {kind: top_kernels(steps, kernels, kind, top) for kind in KINDS}
    return out


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def report(s: dict) -> str:
    gpu = s["kernels"] > 0
    steps = ", ".join(f"{n} {kind}" for kind, n in s["steps"].items())
    lines = [f"window: {s['window_ms']:.2f} ms, steps: {steps}"]
    if gpu:
        lines.append(f"GPU busy: {s['gpu_busy_ms']:.2f} ms (union of {s['window_kernels']} "
                     f"kernels), idle {100 * s['gpu_idle_fraction']:.1f}%")
    else:
        lines.append("no GPU kernels in this trace")
    header = ["kind", "size", "steps", "CPU ms", "GPU ms", "GPU span ms", "host gap ms"]
    keys = ["cpu_ms", "gpu_ms", "span_ms", "gap_ms"] if gpu else ["cpu_ms", "gap_ms"]
    if not gpu:
        header = header[:4] + header[-1:]
    rows = [[g["kind"], g["size"], g["steps"], *(_ms(g[k]) for k in keys)] for g in s["groups"]]
    lines += ["", markdown_table(header, rows)]
    if not gpu:
        return "\n".join(lines)
    for kind, kernels in s["top_kernels"].items():
        if kernels:
            rows = [[k["kernel"], k["count"], f"{k['total_ms']:.3f}",
                     f"{100 * k['share']:.1f}%"] for k in kernels]
            lines += ["", f"top kernels in {kind} steps:", "",
                      markdown_table(["kernel", "count", "total ms", "share"], rows)]
    gaps = s["idle_gaps"]
    total = sum(g["ms"] for g in gaps.values())
    where = ", ".join(f"{g['ms']:.3f} ms in {w} ({g['gaps']})" for w, g in gaps.items())
    lines += ["", f"idle gaps > {GAP_US:.0f} us: {sum(g['gaps'] for g in gaps.values())}, "
                  f"{total:.3f} ms" + (f": {where}" if where else "")]
    return "\n".join(lines)


def trace_machine(trace: dict) -> dict:
    """The host and GPUs the trace names (the stamp would otherwise name this machine)."""
    gpus = [d.get("name") for d in trace.get("deviceProperties") or []]
    return {"host": trace.get("host_name"), "gpus": gpus}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trace", help="a Chrome-trace .json.gz (or .json) the engine wrote")
    p.add_argument("--top", type=int, default=15, help="kernels listed per step kind")
    p.add_argument("--json", help="also write the numbers here")
    args = p.parse_args(argv)
    # Millions of small dicts, none in a cycle: collecting while they are built would take
    # most of the run (three times json.load's own time on a 350 MB trace).
    gc.disable()
    try:
        trace = load_trace(args.trace)
        summary = summarize(trace.get("traceEvents") or [], args.top)
    finally:
        gc.enable()
    print(report(summary))
    if args.json:
        write_json(args.json, {"trace": str(args.trace), "machine": trace_machine(trace),
                               **summary})
    return summary


if __name__ == "__main__":
    main()
