"""The fp32-output GEMMs of the unfused loop and of the fused loop's cuBLAS GEMMs 2 and 3.

Logits and gradients are accumulated AND written in fp32 whatever the input dtype: a bf16 GEMM
output would round every logit to 8 significant bits before the softmax sees it.
"""

from __future__ import annotations

import torch


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
