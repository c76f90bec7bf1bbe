"""Two places where Triton's interpreter (CPU tests) computes differently from the GPU, and the
jit helpers that make the kernels' arithmetic the GPU's on both.

- fp32 -> bf16 casts truncate in the interpreter (the GPU rounds to nearest even): `to_dtype`
  rounds the fp32 bits to nearest even first, which makes the cast exact.
- bf16 x bf16 `tl.dot` tiles are mis-multiplied in the interpreter: `dot` upcasts them to fp32
  there (bf16 products are exact in fp32, so the sum is the GPU's up to summation order).
Both switches are constexprs, False on the GPU, so its kernels carry no extra work.
"""

import triton
import triton.language as tl

from grpo_lce._dispatch import interpreting

__all__ = ["dot", "interpreting", "to_dtype"]


@triton.jit
def to_dtype(v, dtype: tl.constexpr, INTERP: tl.constexpr):
    """v (fp32) cast to dtype, rounding to nearest even also under the interpreter."""
    if INTERP and dtype == tl.bfloat16:
        bits = v.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        v = bits.to(tl.float32, bitcast=True)
    return v.to(dtype)


@triton.jit
def dot(a, b, INTERP: tl.constexpr):
    """a @ b with fp32 accumulation; a, b of one 16-bit dtype."""
    if INTERP:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b)
