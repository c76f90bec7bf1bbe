"""Fixed launch configurations of the Triton kernels, tuned on an H200 (bench/tune_*.py).

A fixed table, not autotuning: one configuration per kernel is within noise of the best across
the head shapes we target (vocabularies of 32k-152k, H = 896-4096); autotuning would only add
warm-up. The timings behind each choice belong with the tuning scripts' results, not here.
"""

# The row kernel (kernels/row_softmax.py; bench/tune_row.py): memory-bound, it streams the
# fp32 chunk; narrower steps (4096) or more warps (16) were slower, 16384 columns spill registers.
ROW_BLOCK_V = 8192  # columns per loop step; fewer for small vocabularies
ROW_NUM_WARPS = 8
# The divergence row kernel (kernels/divergence_rows.py) streams two fp32 chunks and keeps about
# twice the row kernel's live temporaries per column (student and teacher, log m): half its step,
# with the row kernel's warps (bench/tune_divergence.py: narrower or wider steps and 4 or 16
# warps were no faster at H = 2048 and 4096, a larger chunk budget within noise).
DIVERGENCE_BLOCK_V = 4096

# The fused GEMM 1 of kernels/gemm_softmax.py (persistent, TMA tiles; bench/tune_gemm.py),
# statistics only (no G' to write) and with G'. The G' launch runs its epilogue in two column
# halves (EPI_SPLIT=2: half the live registers of the exp2 temporaries); the statistics-only
# one, with less to keep live, in one.
GEMM_STATS = dict(BM=128, BN=256, BK=64, GROUP_M=32, EPI_SPLIT=1, FLATTEN=True, num_warps=8,
                  num_stages=3)
GEMM_GRAD = dict(BM=128, BN=256, BK=64, GROUP_M=8, GROUP_M_MAX=32, EPI_SPLIT=2, FLATTEN=True,
                 num_warps=8, num_stages=3)
# The G' launch's tile groups (kernels/_tma_common.tile_coords; bench/tune_group_m.py): as
# many row tiles as keep their X slab within GROUP_X_BYTES of L2, at least GROUP_M, at most
# GROUP_M_MAX (gemm_softmax.group_m), so that a group sweeps W once while its rows stay in L2.
# It matters at a trainable head's 4096-row chunks (32 row tiles) and small H; a frozen head's
# chunks (~8 row tiles) are one group either way.
GROUP_X_BYTES = 8 * 2**20
GROUP_M_MAX = 32

# GEMMs 2 and 3 of the fused loop (kernels/gemm_rows.py), bounded by the device row count;
# bench/tune_gemm_rows.py. The basis in (256, 128) tiles: no half-empty column block at
# H = 896, where BN = 256 would waste 1/8 of its work.
BASIS_GEMM = dict(BM=256, BN=128, BK=64, num_warps=8, num_stages=4)
GRAD_W_GEMM = dict(BV=128, BN=256, BK=64, GROUP_V=8, FLATTEN=True, num_warps=8, num_stages=4)

# The reduction of GEMM 1's partials (T = V / 256 per row, (T, M) arrays): rows per program and
# partials per step (bench/tune_gemm.py --reduce). Latency-bound at a chunk's few hundred
# rows, so small row blocks (more programs) and long steps win.
REDUCE = dict(BR=8, BT=512, num_warps=8)
