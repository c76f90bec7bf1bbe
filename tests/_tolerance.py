"""Three-way comparison helper: ours and plain torch in the test dtype, both against fp64."""

import torch

# The fused path (test_gemm_softmax, test_device_rows): values come from fp32 logits on both
# paths (1e-6 at those sizes); gradients from a bf16 operand (2^-8 relative) returned in bf16:
# 1e-2 of the gradient's scale.
FUSED_VALUE_ATOL = 5e-5
FUSED_GRAD_RTOL = 1e-2


def max_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return (a.double() - ref.double()).abs().max().item() if a.numel() else 0.0


def assert_3way(ours, torch_same, ref, *, k: float, atol: float, what: str) -> None:
    """err(ours vs fp64) <= k * err(torch in the same dtype vs fp64) + atol; worst element shown."""
    e_ours = max_err(ours, ref)
    e_torch = max_err(torch_same, ref) if torch_same is not None else 0.0
    bound = k * e_torch + atol
    if not e_ours <= bound:
        diff = (ours.double() - ref.double()).abs()
        i = int(diff.reshape(-1).argmax())
        raise AssertionError(
            f"{what}: max |ours - fp64| = {e_ours:.3e} > {k} * {e_torch:.3e} + {atol:.1e}; "
            f"worst flat index {i}: ours {ours.reshape(-1)[i].item():.8g}, "
            f"fp64 {ref.reshape(-1)[i].item():.8g}"
        )


def assert_close_scaled(ours, ref, *, rtol: float, what: str) -> None:
    """max |ours - ref| <= rtol * max |ref| (+ tiny floor): for gradients whose scale varies."""
    scale = max(ref.double().abs().max().item(), 1e-12) if ref.numel() else 1.0
    e = max_err(ours, ref)
    if not e <= rtol * scale + 1e-12:
        diff = (ours.double() - ref.double()).abs()
        i = int(diff.reshape(-1).argmax())
        raise AssertionError(
            f"{what}: max err {e:.3e} > {rtol} * max|ref| {scale:.3e}; worst flat index {i}: "
            f"ours {ours.reshape(-1)[i].item():.8g}, ref {ref.reshape(-1)[i].item():.8g}"
        )
