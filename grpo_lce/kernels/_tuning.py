"""Fixed launch configurations of the row kernel, measured on H100/H200 (scripts/tune_row.py).

A fixed table, not autotuning: the kernel is memory-bound and one configuration is within noise
of the best across the vocabularies we target (32k-152k); autotuning would only add warm-up.
"""

ROW_BLOCK_V = 4096  # columns per loop step; fewer for small vocabularies
ROW_NUM_WARPS = 8
