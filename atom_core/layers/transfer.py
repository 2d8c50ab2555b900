"""Small host lists to the device without making the host wait.

``torch.tensor(values, device="cuda")`` copies from pageable memory, and such a copy waits
for the GPU's queue to drain: with steps queued one ahead (``--async-scheduling``) the host
would stall on the step still running before it could finish queueing the next. The values
go through pinned memory instead, from torch's caching host allocator, which does not hand
a block out again before the copy reading it has run.
"""

from __future__ import annotations

import torch


def host_to_device(
    values: list, dtype: torch.dtype, device: torch.device | str | None
) -> torch.Tensor:
    """``torch.tensor(values, dtype=dtype, device=device)``, asynchronously on CUDA."""
    host = torch.tensor(values, dtype=dtype)
    device = torch.device(device) if device is not None else host.device
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)
