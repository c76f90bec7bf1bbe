"""The device-counted row layout of a call (grpo_lce._rows) in one launch.

A stable partition of the targets y (N,): the rows to process (target not `ignore_index`) first,
in their order, then the ignored ones. Written in the new order: the source row of each
position, its target (0 for an ignored row or a target out of [0, V)), whether that target was
out of range, and whether the position holds a processed row; and the two counts (processed
rows, bad targets). Nothing is read back to the host.

The torch version (_rows, used on CPU) takes about fifteen small ops (compares, a stable
argsort, gathers, wheres), each a launch the host must issue before the first GEMM of the call
can start, while the GPU idles. This is one launch; its GPU time is two passes over N integers
in one program.
"""

from __future__ import annotations

import torch

from grpo_lce.kernels._triton import HAS_TRITON

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _classify(y_ptr, i, N, V, ignore, HAS_IGNORE: tl.constexpr):
        inside = i < N
        y = tl.load(y_ptr + i, mask=inside, other=0).to(tl.int64)
        keep = inside
        if HAS_IGNORE:
            keep = keep & (y != ignore)
        bad = keep & ((y < 0) | (y >= V))
        return inside, y, keep, bad

    @triton.jit
    def _partition_kernel(
        y_ptr, N, V, ignore,
        order_ptr, y_rows_ptr, bad_ptr, valid_ptr, count_ptr,
        HAS_IGNORE: tl.constexpr, BLOCK: tl.constexpr,
    ):
        # pass 1: how many rows are kept (the ignored ones start there), how many are bad
        n_keep = tl.sum(tl.zeros((BLOCK,), tl.int32), axis=0)
        n_bad = n_keep
        for s in range(0, N, BLOCK):
            i = s + tl.arange(0, BLOCK)
            inside, y, keep, bad = _classify(y_ptr, i, N, V, ignore, HAS_IGNORE)
            n_keep += tl.sum(keep.to(tl.int32), axis=0)
            n_bad += tl.sum(bad.to(tl.int32), axis=0)
        # pass 2: each row's position, from running counts and in-block prefix sums
        run_keep = n_keep * 0
        run_drop = n_keep * 0
        for s in range(0, N, BLOCK):
            i = s + tl.arange(0, BLOCK)
            inside, y, keep, bad = _classify(y_ptr, i, N, V, ignore, HAS_IGNORE)
            k = keep.to(tl.int32)
            d = (inside & ~keep).to(tl.int32)
            pos = tl.where(keep, run_keep + tl.cumsum(k, axis=0) - 1,
                           n_keep + run_drop + tl.cumsum(d, axis=0) - 1)
            tl.store(order_ptr + pos, i.to(tl.int64), mask=inside)
            tl.store(y_rows_ptr + pos, tl.where(keep & ~bad, y, 0), mask=inside)
            tl.store(bad_ptr + pos, bad.to(tl.int8), mask=inside)
            tl.store(valid_ptr + pos, keep.to(tl.int8), mask=inside)
            run_keep += tl.sum(k, axis=0)
            run_drop += tl.sum(d, axis=0)
        tl.store(count_ptr, n_keep)
        tl.store(count_ptr + 1, n_bad)


def partition_rows(y: torch.Tensor, vocab: int, ignore_index: int | None):
    """(order int64, y_rows int64, bad bool, valid bool, counts int32 (2,)) for targets y (N,),
    N >= 1, each (N,) in the new order (module docstring); counts = (processed rows, bad
    targets). One Triton launch (the interpreter on CPU)."""
    N = y.numel()
    dev = y.device
    order = torch.empty(N, device=dev, dtype=torch.int64)
    y_rows = torch.empty(N, device=dev, dtype=torch.int64)
    flags = torch.empty(2, N, device=dev, dtype=torch.int8)  # bad, valid
    counts = torch.empty(2, device=dev, dtype=torch.int32)
    _partition_kernel[(1,)](
        y, N, vocab, 0 if ignore_index is None else ignore_index,
        order, y_rows, flags[0], flags[1], counts,
        HAS_IGNORE=ignore_index is not None, BLOCK=1024, num_warps=4,
    )
    flags = flags.view(torch.bool)
    return order, y_rows, flags[0], flags[1], counts
