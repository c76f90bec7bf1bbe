"""Random LM-head inputs shared by the core tests."""

import torch


def head_inputs(N, H, V, dtype, with_bias, n_ignored, seed=0):
    """hidden (N, H), weight (V, H), bias (V,) or None, targets (N,) with n_ignored at -100.

    Weights of std 3/sqrt(H) give logits of O(3): a peaked but not one-hot softmax, like a real
    head."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, H, generator=g).to(dtype)
    w = (torch.randn(V, H, generator=g) * 3 / H**0.5).to(dtype)
    b = (torch.randn(V, generator=g) * 0.5).to(dtype) if with_bias else None
    y = torch.randint(0, V, (N,), generator=g)
    if n_ignored:
        y[torch.randperm(N, generator=g)[:n_ignored]] = -100
    return h, w, b, y
