"""Tuning tables as data: ``configs/<op>/<device>.json``, one file per op and GPU model.

A file holds a header (``device``: the name ``torch.cuda.get_device_name`` gives;
``producer``: the command that measured it; ``commit`` and ``date`` of that measurement)
and ``configs``: shape -> bucket -> launch parameters, a shape being its sizes joined by
commas (``"2048,768"``) and a bucket an integer (``"32"``); a null config means "not this
kernel" (the op's own fallback, e.g. cuBLAS). Ops may add fields of their own beside it.

Where no file names the device - another GPU, or CPU tensors under the interpreter - an op
gets an empty table, so its built-in heuristics choose every launch. Which table each op
uses is logged once at INFO.
"""

from __future__ import annotations

import datetime
import functools
import json
import logging
import os
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

CONFIG_DIR = Path(__file__).resolve().parent / "configs"

# (shape) -> {bucket: launch parameters, or None where the kernel is not used}
Table = dict[tuple[int, ...], dict[int, dict[str, Any] | None]]


@dataclass
class TableFile:
    """One op's table for one device, as read; ``path`` is None where none exists."""

    op: str
    device: str | None
    configs: Table
    header: dict[str, Any] = field(default_factory=dict)
    path: Path | None = None


@functools.cache
def _name_of(device: torch.device) -> str | None:
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_name(device)


def device_name(device: torch.device | str | None = None) -> str | None:
    """The GPU model of ``device`` (default: the current CUDA device), None for CPU tensors
    and where torch sees no GPU."""
    if device is None:
        if not torch.cuda.is_available():
            return None
        device = torch.device("cuda", torch.cuda.current_device())
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return _name_of(device)


def file_stem(device: str) -> str:
    """A device name as a file name: ``"NVIDIA H200"`` -> ``"NVIDIA_H200"``."""
    return re.sub(r"[^0-9A-Za-z]+", "_", device).strip("_")


def table_path(op: str, device: str, config_dir: Path = CONFIG_DIR) -> Path:
    return config_dir / op / f"{file_stem(device)}.json"


def decode_configs(raw: dict[str, dict[str, Any]]) -> Table:
    return {
        tuple(int(s) for s in shape.split(",")): {int(b): c for b, c in buckets.items()}
        for shape, buckets in raw.items()
    }


def encode_configs(table: Table) -> dict[str, dict[str, Any]]:
    return {
        ",".join(map(str, shape)): {str(b): table[shape][b] for b in sorted(table[shape])}
        for shape in sorted(table)
    }


@functools.cache
def load(op: str, device: str | None) -> TableFile:
    """``op``'s table for the device named ``device``, read once; the object is shared, so
    a benchmark's override of an entry reaches every later launch."""
    path = table_path(op, device) if device is not None else None
    if path is None or not path.is_file():
        logger.info("%s: no tuning table for %s; built-in heuristics", op, device or "CPU")
        return TableFile(op, device, {})
    data = json.loads(path.read_text())
    header = {k: v for k, v in data.items() if k != "configs"}
    logger.info("%s: tuning table %s (%s)", op, path.name, data.get("commit", "?")[:12])
    return TableFile(op, device, decode_configs(data["configs"]), header, path)


@functools.cache
def table_for(op: str, device: torch.device) -> Table:
    """``op``'s table for the device a tensor is on (cached per device, for the launch path)."""
    return load(op, device_name(device)).configs


def in_model(op: str, device: str | None) -> frozenset[tuple[int, ...]]:
    """(shape..., bucket) of the entries of ``op``'s table chosen by timing the whole model,
    which the sweep that rewrites the table keeps (the file's ``in_model``)."""
    return frozenset(tuple(e) for e in load(op, device).header.get("in_model", ()))


def git_commit(repo: Path = CONFIG_DIR) -> str:
    """The commit for a table's header: ``ATOM_BENCH_COMMIT`` where it is a full hash (a
    device machine's copy of the tree has no .git of its own), else the checkout's HEAD,
    else "unknown"."""
    named = os.environ.get("ATOM_BENCH_COMMIT", "").strip()
    if re.fullmatch(r"[0-9a-f]{40}", named):
        return named
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True, check=True
        )
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return out.stdout.strip()


def dump(
    path: Path, device: str, configs: Table, producer: str, commit: str | None = None,
    date: str | None = None, **extra: Any,
) -> None:
    """Write a table file: the header, then ``configs``, then any op-specific ``extra``."""
    data = {
        "device": device,
        "producer": producer,
        "commit": commit or git_commit(),
        "date": date or datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
        "configs": encode_configs(configs),
        **extra,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(_format(data))


def _format(data: dict[str, Any]) -> str:
    """JSON with one line per bucket, so a table reads (and diffs) as rows."""
    fields = []
    for key, value in data.items():
        if key != "configs":
            fields.append(f" {json.dumps(key)}: {json.dumps(value)}")
            continue
        shapes = []
        for shape, buckets in value.items():
            rows = ",\n".join(f"   {json.dumps(b)}: {json.dumps(c)}" for b, c in buckets.items())
            shapes.append(f"  {json.dumps(shape)}: {{\n{rows}\n  }}")
        fields.append(' "configs": {\n' + ",\n".join(shapes) + "\n }")
    return "{\n" + ",\n".join(fields) + "\n}\n"
