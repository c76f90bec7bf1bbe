"""Fixed launch configurations of the row kernel, measured on an H200 (scripts/tune_row.py).

A fixed table, not autotuning: the kernel is memory-bound and one configuration is within noise
of the best across the vocabularies we target (32k-152k); autotuning would only add warm-up.
"""

# H200, N=8192 H=2048 V=128256: the kernel streams the fp32 chunk at 3.7-4.1 TB/s with these;
# 4096 or 16 warps are 5-15% slower, 16384 columns spill.
ROW_BLOCK_V = 8192  # columns per loop step; fewer for small vocabularies
ROW_NUM_WARPS = 8

# The fused GEMM 1 of kernels/gemm_softmax.py (persistent, TMA tiles), measured on an H200 with
# scripts/tune_gemm.py at V=128256, H=2048 and V=151936, H=896: statistics only (no G' to
# write) and with G'. Since the target logit left the epilogue (kernels/target_logit), the G'
# launch is faster in two column halves (EPI_SPLIT=2: 3.80 against 3.95 ms at H = 896, 6.82
# against 6.89 ms at H = 2048), the statistics-only one in one (3.43 against 3.57 ms at H = 896,
# 6.20 against 6.53 at H = 2048; tune_gemm_H200_*_target_logit.json).
GEMM_STATS = dict(BM=128, BN=256, BK=64, GROUP_M=32, EPI_SPLIT=1, FLATTEN=True, num_warps=8,
                  num_stages=3)
GEMM_GRAD = dict(BM=128, BN=256, BK=64, GROUP_M=8, GROUP_M_MAX=32, EPI_SPLIT=2, FLATTEN=True,
                 num_warps=8, num_stages=3)
# The G' launch's tile groups (kernels/_tma_common.tile_coords) at a trainable head's 4096-row
# chunks (32 row tiles): as many row tiles as keep their X slab within GROUP_X_BYTES of L2, at
# least GROUP_M, at most GROUP_M_MAX. Interleaved A/B on an H200 (floor timed every round,
# median of 6 rounds' ratios to three GEMMs), CE with a trainable head: qwen-0.5b (H = 896)
# 1.103x with groups of 8, 1.079x with 32 (the rule's 32); llama-1b (H = 2048) 1.043 / 1.037
# (16) / 1.037; llama-8b (H = 4096) 1.023 (8) / 1.023 / 1.027. About 1 % of that case's time at
# H = 896, of the order of the round-to-round noise (bench/results/tune_group_m_H200.txt,
# scripts/tune_group_m.py). Smaller chunks (a frozen head's ~8 row tiles) are one group either
# way.
GROUP_X_BYTES = 8 * 2**20
GROUP_M_MAX = 32

# GEMMs 2 and 3 of the fused loop (kernels/gemm_rows.py), bounded by the device row count;
# scripts/tune_gemm_rows.py. The basis in (256, 128) tiles: no half-empty column block at
# H = 896 (BN = 256 wasted 1/8 of its work there): 0.316 ms against 0.333 for (128, 256) on a
# 768-row chunk at H = 896, 0.741 against 0.830 on a 1024-row chunk at H = 2048, 1.63 against
# 1.62 at H = 4096 (tune_gemm_rows_H200_basis.json).
BASIS_GEMM = dict(BM=256, BN=128, BK=64, num_warps=8, num_stages=4)
GRAD_W_GEMM = dict(BV=128, BN=256, BK=64, GROUP_V=8, FLATTEN=True, num_warps=8, num_stages=4)

# The reduction of GEMM 1's partials (T = V / 256 per row, (T, M) arrays): rows per program and
# partials per step. Latency-bound at a chunk's few hundred rows, so small row blocks (more
# programs) and long steps win: 13.6 us against 21.6 us for (32, 64, 4) on a 768-row chunk at
# V = 151936, 37.6 us against 60.4 us with entropy and argmax (scripts/tune_gemm.py --reduce,
# tune_gemm_H200_qwen0.5b_chunk768_quick.json).
REDUCE = dict(BR=8, BT=512, num_warps=8)
