"""A Triton kernel that only reads: `bench.decode_linear.read_floor` times it on a linear's floor
bytes, what a launch that reads those bytes from HBM and does nothing else costs on this GPU (its
launch, the first loads' latency and the stream itself). Its own module, imported where it runs, so that
importing the benchmark does not import Triton before the CPU smoke run sets TRITON_INTERPRET.

Each program XORs the int32 words of blocks pid, pid + P, pid + 2P, ... (P programs) and stores
one word: the XOR of every program's word is the XOR of every word of the buffer, which the
tests check (a word read twice or never would change it)."""

import triton
import triton.language as tl


@triton.jit
def read_kernel(src, out, n_words, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(pid * BLOCK, n_words, tl.num_programs(0) * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        acc = acc ^ tl.load(src + offs, mask=offs < n_words, other=0)
    tl.store(out + pid, tl.xor_sum(acc, 0))
