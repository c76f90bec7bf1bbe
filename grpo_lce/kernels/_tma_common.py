"""Pieces shared by the TMA GEMM kernels (gemm_softmax, gemm_rows): tile order, SM count, the
multiply-accumulate of a K step, and the device-side row count of a chunk; and the bf16 rounding
that keeps the interpreter's arithmetic the GPU's (also used by row_gather, scale_cast and
target_terms). None of them needs tensor descriptors: only HAS_TRITON guards them."""

from __future__ import annotations

import torch

from grpo_lce.kernels._triton import HAS_TRITON

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def tile_coords(tile, num_m, num_n, GROUP_M: tl.constexpr):
        # Tiles of GROUP_M row blocks share each column block while it is in L2 (the big
        # operand is read once per group of row blocks instead of once per row block).
        per_group = GROUP_M * num_n
        first_m = (tile // per_group) * GROUP_M
        size_m = tl.minimum(num_m - first_m, GROUP_M)
        pid_m = first_m + (tile % per_group) % size_m
        pid_n = (tile % per_group) // size_m
        return pid_m, pid_n

    @triton.jit
    def dot_acc(a, b, acc, DOT_F32: tl.constexpr):
        """acc + a @ b. DOT_F32 (Triton's interpreter, CPU tests) upcasts the tiles first: the
        interpreter mis-multiplies bf16 tiles."""
        if DOT_F32:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        return tl.dot(a, b, acc)

    @triton.jit
    def round_to_bf16(x):
        """x (fp32) rounded to the nearest-even bf16 value, still fp32. Triton's interpreter
        (CPU tests) truncates fp32 -> bf16 where the GPU rounds to nearest even: rounding first
        makes the cast exact, so the tests see the GPU's arithmetic."""
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)

    @triton.jit
    def valid_in_chunk(n_valid_ptr, row0, M):
        """Rows of the chunk [row0, row0 + M) below the device count *n_valid_ptr."""
        return tl.minimum(tl.maximum(tl.load(n_valid_ptr) - row0, 0), M)


_NUM_SMS: dict[int, int] = {}


def num_programs(device: torch.device) -> int:
    """Programs of a persistent launch: one per SM (a few under the CPU interpreter, enough to
    exercise the persistent loop)."""
    if device.type != "cuda":
        return 4
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _NUM_SMS:
        _NUM_SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _NUM_SMS[idx]
