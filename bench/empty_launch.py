"""A Triton kernel that does nothing but PDL's wait: `bench.decode_linear.launch_floor` times it,
the least a kernel of the decode step's chain costs whatever it reads. Its own module, imported
where it runs, so that importing the benchmark does not import Triton before the CPU smoke run
sets TRITON_INTERPRET."""

import triton
import triton.language as tl

from trainers.sampling.kernels.pdl import grid_wait


@triton.jit
def empty_kernel(PDL: tl.constexpr):
    grid_wait(PDL)
