"""Arrival counters: how a split launch's last program to finish a tile finds out it is last.

A kernel whose programs each write a partial result of one output tile counts arrivals per tile
(`tl.atomic_add(count + tile, 1, sem="acq_rel")`); the program that sees `arrivals - 1` sums the
partials (every other program's stores happened before its release, this one's loads after its
acquire) and sets the counter back to 0, so the counters are zero between calls and no launch
has to clear them. One buffer per device serves every such kernel: their calls must not overlap
in time (one stream, as the decode step runs).
"""

from __future__ import annotations

import torch

COUNTERS: dict = {}  # device -> int32 counters, zero between calls
_RETIRED: list = []  # outgrown buffers: captured graphs may still point at them


def arrival_counters(device: torch.device, n: int) -> torch.Tensor | None:
    """At least `n` zeroed int32 counters on `device` (the module docstring's protocol keeps them
    zero). None while a CUDA graph is being captured and no large enough buffer exists yet
    (allocating it then would tie it to the graph's memory pool): the caller then combines its
    partials another way (a second launch, torch ops)."""
    buf = COUNTERS.get(device)
    if buf is None or buf.numel() < n:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        if buf is not None:
            _RETIRED.append(buf)
        buf = torch.zeros(max(n, 4096), dtype=torch.int32, device=device)
        COUNTERS[device] = buf
    return buf
