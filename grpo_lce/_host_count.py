"""The device-counted row count on its way to the host, for a trainable head's cuBLAS GEMMs.

In the device-counted layout (grpo_lce._rows) the number of valid rows lives on the device. A
frozen head never needs it on the host. A trainable head's dW GEMM is faster in cuBLAS than in
the Triton kernel that reads the count on the device (kernels/gemm_rows), and cuBLAS needs the
count on the host. So the count is copied to pinned host memory right behind the partition
kernel, without waiting, and the chunk loop reads it only after it has queued chunk 0's GEMM 1:
the host then waits for the partition kernel alone while the GPU has a GEMM to run, where a
read before the first GEMM would leave the GPU idle while the host waits.
"""

from __future__ import annotations

import torch


class HostCount:
    """The count n_valid (int32 (1,)) copied to the host as soon as it is queued; `get` waits
    for that copy only (an event), not for the kernels queued after it. On CPU the count is
    already there."""

    def __init__(self, n_valid: torch.Tensor):
        self._event = None
        if n_valid.is_cuda:
            self._host = torch.empty(1, dtype=n_valid.dtype, pin_memory=True)
            self._host.copy_(n_valid, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = n_valid
        self._value: int | None = None

    def get(self) -> int:
        if self._value is None:
            if self._event is not None:
                self._event.synchronize()
            self._value = int(self._host[0])
        return self._value
