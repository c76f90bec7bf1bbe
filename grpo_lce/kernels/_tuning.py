"""Fixed launch configurations of the row kernel, measured on an H200 (scripts/tune_row.py).

A fixed table, not autotuning: the kernel is memory-bound and one configuration is within noise
of the best across the vocabularies we target (32k-152k); autotuning would only add warm-up.
"""

# H200, N=8192 H=2048 V=128256: the kernel streams the fp32 chunk at 3.7-4.1 TB/s with these;
# 4096 or 16 warps are 5-15% slower, 16384 columns spill.
ROW_BLOCK_V = 8192  # columns per loop step; fewer for small vocabularies
ROW_NUM_WARPS = 8
