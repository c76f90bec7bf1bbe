"""Row compaction, chunk sizing and the fp32-output GEMM shared by every op.

Fused path (_head_fused, Hopper + bf16): a chunk holds G' (C, V) in bf16 when a gradient is
wanted (`fused_chunk_size`), otherwise only per-tile statistics. Unfused path, memory model of
one chunk of C rows (V = vocabulary):
    Z    (C, V) fp32              the logits of the chunk, one reused buffer
    G    over Z's own bytes        the gradient operand (see _head.g_over_z): free
    E    (C, V) in the GEMM dtype  the entropy operand, only for an entropy basis
so a chunk costs C · V · (4 + 2·k) bytes, k = 1 with E, else 0. The default chunk size fills
`DEFAULT_CHUNK_BUDGET_BYTES` (256 MiB: 512 rows of a 128k vocabulary), but a call over few rows
N uses at least `MIN_CHUNKS` chunks (of >= 64 rows): its chunk then holds <= 1/8 of the fp32
logits of the call, so small calls cost memory in proportion to their tokens, like the
activations around them (one 1024-token SFT row on a 128k vocabulary: 128 rows, 66 MB, where
the full budget would add 256 MiB to a step whose backbone peak is ~0.2 GiB). Pass
`chunk_size=` to any public function to override all this per call. Larger chunks amortise
reading W (V, H) once per GEMM. A trainable head accumulates dW (V, H) in fp32 once per
chunk, so there the chunk is at least `MIN_ROWS_GRAD_WEIGHT` rows (measured on an H200 at
V=128256, H=2048: 320-row chunks make the dW accumulation 3x slower than one GEMM, 1024-row
chunks 1.3x), even above the budget.
"""

from __future__ import annotations

import torch

from grpo_lce._checks import check_target_range

DEFAULT_CHUNK_BUDGET_BYTES = 256 * 2**20
MIN_ROWS_GRAD_WEIGHT = 1024
# The fused loop's G' is bf16 (2 bytes a logit): 4096 rows hold 1 GiB at 128k. dW's fp32
# read-modify-write per chunk (2 GiB at 128k x 2048) is what small chunks pay for: on an H200
# (bench_head, case iii, llama-1b) 2048-row chunks ran 1.12x three GEMMs, 4096-row ones 1.09x
# (2.2 GiB extra in all, against torch.compile's 2.5 GiB).
MIN_ROWS_GRAD_WEIGHT_FUSED = 4096
MIN_CHUNKS = 8

# Keep the row count of a chunk a multiple of this, so the GEMMs see tensor-core friendly M.
_ROW_ALIGN = 64
# The fused loop's chunks are whole row tiles of its Triton GEMMs (BM = 128): an 832-row chunk
# (the 256 MiB budget at V = 151936) ran 6.5 tiles, its last one half empty, in GEMMs 1 and 2.
_ROW_ALIGN_FUSED = 128


def default_chunk_size(
    vocab: int,
    n_operands: int = 0,
    operand_bytes: int = 2,
    budget_bytes: int | None = None,
    n_rows: int | None = None,
) -> int:
    """Rows per chunk of the unfused loop, so that Z (fp32) plus `n_operands` separate (C, V)
    buffers fit the budget (default `DEFAULT_CHUNK_BUDGET_BYTES`); for a call over `n_rows`
    rows, also no more than ⌈n_rows / MIN_CHUNKS⌉ rounded up to a multiple of 64 (module
    docstring)."""
    return _rows_within(vocab * (4 + n_operands * operand_bytes), budget_bytes, n_rows)


def fused_chunk_size(
    vocab: int, n_parts: int, n_part_arrays: int, with_operand: bool, n_rows: int
) -> int:
    """Rows per chunk of the fused loop (_head_fused), in multiples of 128 rows. With a gradient
    the chunk holds G' (C, V) in bf16 (rows padded to 16 bytes): the budget rule above with 2
    bytes per logit instead of 4. Without one it holds only the partial statistics (n_parts per
    row, 4 bytes each, in `n_part_arrays` arrays: ~8 KB a row at 128k), so the whole call
    usually fits one chunk."""
    if with_operand:
        return _rows_within(-(-vocab // 8) * 8 * 2, None, n_rows, _ROW_ALIGN_FUSED)
    return _rows_within(n_parts * 4 * n_part_arrays, None, None, _ROW_ALIGN_FUSED)


def _rows_within(per_row: int, budget_bytes: int | None, n_rows: int | None,
                 align: int = _ROW_ALIGN) -> int:
    if budget_bytes is None:
        budget_bytes = DEFAULT_CHUNK_BUDGET_BYTES
    rows = max(1, budget_bytes // max(per_row, 1))
    if rows >= align:
        rows -= rows % align
    if n_rows is not None:
        share = -(-n_rows // MIN_CHUNKS)
        rows = min(rows, max(align, -(-share // align) * align))
    return int(rows)


def compact_rows(
    y: torch.Tensor, vocab: int, ignore_index: int | None, name: str
) -> tuple[torch.Tensor | None, int]:
    """Indices of the rows whose target is not `ignore_index`, and their number.

    Returns (None, N) when every row is kept. The one host read of the call happens here: the
    number of valid rows sizes every GEMM that follows, and the target range check rides on the
    same read (so a bad target is an error, never an out-of-bounds gather in a kernel).
    """
    n = y.numel()
    if n == 0:
        return None, 0
    out_of_range = (y < 0) | (y >= vocab)
    if ignore_index is None:
        if bool(out_of_range.any()):
            check_target_range(y, vocab, ignore_index, name)
        return None, n
    keep = y != ignore_index
    n_keep, n_bad = torch.stack([keep.sum(), (out_of_range & keep).sum()]).tolist()
    if n_bad:
        check_target_range(y, vocab, ignore_index, name)
    if n_keep == n:
        return None, n
    # nonzero_static needs no second host read: the size is already known.
    idx = torch.nonzero_static(keep, size=n_keep).squeeze(1)
    return idx, n_keep


def mm_f32(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """a @ b with fp32 accumulation AND fp32 output, whatever the input dtype.

    On CUDA with bf16/fp16 inputs this is one cuBLAS call writing fp32 (no bf16 rounding of the
    logits); elsewhere the inputs are upcast first (CPU has no mixed-dtype mm).
    """
    if a.dtype == torch.float32:
        return torch.mm(a, b, out=out)
    if a.is_cuda:
        if out is None:
            return torch.mm(a, b, out_dtype=torch.float32)
        return torch.mm(a, b, out_dtype=torch.float32, out=out)
    return torch.mm(a.float(), b.float(), out=out)


def accumulate_mm(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, first: bool = False
                  ) -> None:
    """acc (fp32) += a @ b with fp32 accumulation, without an fp32 temporary of acc's size;
    `first`: acc = a @ b (acc's old contents, e.g. torch.empty's, are not read)."""
    if first:
        mm_f32(a, b, out=acc)
        return
    if a.dtype == torch.float32:
        acc.addmm_(a, b)
    elif acc.is_cuda:
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    else:
        acc.addmm_(a.float(), b.float())


def chunk_bounds(n: int, chunk: int):
    """(start, end) of consecutive chunks covering n rows."""
    for start in range(0, n, chunk):
        yield start, min(start + chunk, n)
