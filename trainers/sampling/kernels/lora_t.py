"""LoRA's t = x @ Aᵀ handed from the kernel that forms x to the decode linear that reads it.

A LoRA projection adds s · B (A x) to its base output; for one decode step's rows x (M, K) and a
rank-R factor A (R, K) the down-projection t = x @ Aᵀ (M, R) is tiny, but the warp-specialized
linear (`linear4bit_ws`) forms it in every CTA: each of its tiles streams A beside the packed
weight and runs t's MMAs again, the same t in every tile. The kernel that writes x can form t
instead, once: `add_rmsnorm` writes the q/k/v and gate/up projections' input, and with
`lora_a` its programs also leave t for those projections' factors, in P parts over K:

    T[p, j·R + r, m] = Σ_{k ∈ K_p} A_j[r, k] · x[m, k]     (fp32 sums, K_p the p-th of P slices)
    t_j[m, r] = Σ_{p < P} T[p, j·R + r, m]                 (summed from zero, p in order)

The linear sums the parts in its epilogue instead of running A's loads and MMAs in its K loop.
x here is the bf16 tensor the linear reads (the norm's rounded output), so t is the same
Σ_k A x over another order of fp32 sums: the linear's bound (in-loop t, its own sum order) holds.

`LoraT` is that hand-over: the parts, and which x and factors they were formed from, so that a
linear given t for other operands refuses it (`check`) rather than add a wrong term.
`lora_t_torch` is the same t in torch ops (the CPU path and the tests' reference).
"""

from __future__ import annotations

import dataclasses

import torch

# slices of K the norm's programs split t over (each program one row's slice; the linear sums
# them). K / PARTS columns of each factor a program: 512 at the 8B's 4096
PARTS = 8


@dataclasses.dataclass(frozen=True)
class LoraT:
    """T (P, J·R, M) fp32 (module docstring) for the factors `a` (J tensors (R, K)) and the
    rows x (M, K) at `x_ptr`."""

    parts: torch.Tensor
    a: tuple
    x_ptr: int

    def check(self, x: torch.Tensor, factors: list) -> None:
        """ValueError unless this t was formed from x and exactly these factors, in order."""
        mine = [(a.data_ptr(), tuple(a.shape)) for a in self.a]
        theirs = [(None, None) if a is None else (a.data_ptr(), tuple(a.shape))
                  for a in factors]
        if x.data_ptr() != self.x_ptr or mine != theirs or self.parts.shape[2] != x.shape[0]:
            raise ValueError(f"lora_t was formed from another x or other LoRA factors (x at "
                             f"{self.x_ptr:#x} with factors {mine}; this launch has x at "
                             f"{x.data_ptr():#x} {tuple(x.shape)} with factors {theirs})")


def lora_t_torch(x: torch.Tensor, a: tuple) -> torch.Tensor:
    """T (1, J·R, M): every factor's x @ Aᵀ in fp32, as one part."""
    xf = x.reshape(-1, x.shape[-1]).float()
    return torch.cat([aj.float() @ xf.T for aj in a])[None]


def check_factors(a: tuple, h: int, device: torch.device) -> None:
    """ValueError naming `lora_a` unless it holds 1 to 3 factors (R, h) of one rank and dtype
    on `device`, each with a unit column stride."""
    if not 1 <= len(a) <= 3:
        raise ValueError(f"lora_a holds {len(a)} factors; it takes 1 to 3 (q/k/v, gate/up)")
    r, dt = a[0].shape[0], a[0].dtype
    for i, aj in enumerate(a):
        if aj.dim() != 2 or aj.shape != (r, h) or aj.dtype != dt or aj.stride(1) != 1 \
                or aj.device != device:
            raise ValueError(f"lora_a[{i}] is {tuple(aj.shape)} {aj.dtype} on {aj.device} "
                             f"(strides {aj.stride()}); expected ({r}, {h}) {dt} on {device} "
                             "with unit column stride, as lora_a[0]")
