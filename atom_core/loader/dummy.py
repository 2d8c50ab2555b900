"""Dummy weights from a config alone (no checkpoint read), for benchmarks and tests."""

from __future__ import annotations

import torch
from torch import nn

from atom_core.config import LOAD_DUMMY_MODES


@torch.no_grad()
def init_dummy_weights(model: nn.Module, mode: str, seed: int = 0) -> set[str]:
    """Fill ``model``'s parameters; returns their names (all of them count as loaded).

    ``empty`` leaves the memory uninitialised (fastest; only for timing); ``zero`` zeroes
    every parameter; ``xavier`` draws 2-D weights xavier-uniform from ``seed`` on their own
    device (the same seed gives the same weights on the same kind of device; drawing an 8B
    model's on a host CPU took most of a minute), sets norm weights to one and biases to
    zero.
    """
    if mode not in LOAD_DUMMY_MODES:
        raise ValueError(f"dummy weight mode must be one of {LOAD_DUMMY_MODES}, got {mode!r}")
    names = {name for name, _ in model.named_parameters()}
    if mode == "empty":
        return names
    generators: dict[torch.device, torch.Generator] = {}
    for name, param in model.named_parameters():
        if mode == "zero" or name.endswith(".bias"):
            param.zero_()
        elif param.dim() >= 2:
            if param.device not in generators:
                generators[param.device] = torch.Generator(param.device).manual_seed(seed)
            values = torch.empty(param.shape, dtype=torch.float32, device=param.device)
            nn.init.xavier_uniform_(values, generator=generators[param.device])
            param.copy_(values)
        else:  # 1-D weights are norm scales
            param.fill_(1.0)
    return names
