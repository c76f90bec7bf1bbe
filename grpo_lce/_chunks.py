"""How many rows a chunk of the chunk loop holds.

Unfused loop (grpo_lce._head), memory of one chunk of C rows (V = vocabulary):
    Z    (C, V) fp32              the logits of the chunk, one reused buffer
    G    over Z's own bytes        the gradient operand (see _head.g_over_z): free
    E    (C, V) in the GEMM dtype  the entropy operand, only for an entropy basis
so a chunk costs C · V · (4 + 2·k) bytes, k = 1 with E, else 0. Fused loop (grpo_lce._head):
a chunk holds G' (C, V) in bf16 when a gradient is wanted (`fused_chunk_size`), otherwise only
per-tile statistics.

The default chunk size fills `DEFAULT_CHUNK_BUDGET_BYTES` (256 MiB: 512 rows of a 128k
vocabulary), but a call over few rows N uses at least `MIN_CHUNKS` chunks (of >= 64 rows): its
chunk then holds <= 1/8 of the fp32 logits of the call, so small calls cost memory in
proportion to their tokens, like the activations around them (one 1024-token SFT row on a 128k
vocabulary: 128 rows, 66 MB, where the full budget would add 256 MiB to a step whose backbone
needs little more). Pass `chunk_size=` to any public function to override all this per call.

Larger chunks amortise reading W (V, H) once per GEMM. A trainable head reads and writes dW
(V, H) in fp32 once per chunk, a cost that does not shrink with the chunk, so there the chunk
is at least `MIN_ROWS_GRAD_WEIGHT` rows (`MIN_ROWS_GRAD_WEIGHT_FUSED` on the fused path), even
above the budget.
"""

from __future__ import annotations

DEFAULT_CHUNK_BUDGET_BYTES = 256 * 2**20
MIN_ROWS_GRAD_WEIGHT = 1024
# The fused loop's G' is bf16 (2 bytes a logit): 4096 rows hold 1 GiB at 128k, and dW's fp32
# read-modify-write per chunk (2 GiB at 128k x 2048) is then paid over 4096 rows.
MIN_ROWS_GRAD_WEIGHT_FUSED = 4096
MIN_CHUNKS = 8

# Keep the row count of a chunk a multiple of this, so the GEMMs see tensor-core friendly M.
_ROW_ALIGN = 64
# The fused loop's chunks are whole row tiles of its Triton GEMMs (BM = 128): no half-empty
# last row tile in GEMMs 1 and 2.
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
    """Rows per chunk of the fused loop (grpo_lce._head), in multiples of 128 rows. With a
    gradient the chunk holds G' (C, V) in bf16 (rows padded to 16 bytes): the budget rule above
    with 2 bytes per logit instead of 4. Without one it holds only the partial statistics
    (n_parts per row, 4 bytes each, in `n_part_arrays` arrays: ~8 KB a row at 128k), so the
    whole call usually fits one chunk."""
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


def chunk_bounds(n: int, chunk: int):
    """(start, end) of consecutive chunks covering n rows."""
    for start in range(0, n, chunk):
        yield start, min(start + chunk, n)
