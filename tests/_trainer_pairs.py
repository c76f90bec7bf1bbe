"""Helpers the DPO / KTO / RLOO trainer tests share: run one `compute_loss` + backward and
compare ours against stock TRL (loss, gradients, logged metrics, training logs)."""

from __future__ import annotations

import pytest
import torch


def assert_close(ours, ref, *, rtol=0.0, atol=0.0, what=""):
    """max |ours − ref| <= atol + rtol · max |ref|, with the worst error in the message."""
    ours, ref = torch.as_tensor(ours).double(), torch.as_tensor(ref).double()
    err = (ours - ref).abs().max().item() if ref.numel() else 0.0
    bound = atol + rtol * (ref.abs().max().item() if ref.numel() else 0.0)
    assert err <= bound, f"{what}: max err {err:.3e} > {bound:.3e}"


def grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def loss_step(tr, inputs, **kwargs):
    """(loss, grads, logged metrics) of one `compute_loss` + backward on `inputs`."""
    tr.model.zero_grad(set_to_none=True)
    loss = tr.compute_loss(tr.model, dict(inputs), **kwargs)
    loss.backward()
    return loss.detach(), grads(tr.model), {k: list(v) for k, v in tr._metrics["train"].items()}


def randomize_adapter(model, *, seed: int, adapter: str = "default") -> None:
    """Random lora_B weights of `adapter` (the same for the same seed), so that a policy whose
    reference is the initial adapter or no adapter differs from it."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if f"lora_B.{adapter}." in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)


def assert_same_step(stock_step, ours_step, *, loss_rtol, grad_rtol, metric_rel, metric_abs,
                     lora_only=True):
    """Loss, gradients (the same parameters, each within grad_rtol · its max) and every logged
    metric of two `loss_step` results."""
    (loss_s, g_s, m_s), (loss_o, g_o, m_o) = stock_step, ours_step
    assert_close(loss_o, loss_s, rtol=loss_rtol, atol=1e-7, what="loss")
    assert g_s.keys() == g_o.keys() and len(g_s) > 0
    if lora_only:
        assert all("lora_" in n for n in g_s), [n for n in g_s if "lora_" not in n]
    for n in g_s:
        assert_close(g_o[n], g_s[n], rtol=grad_rtol, atol=1e-10, what=f"grad {n}")
    assert m_s.keys() == m_o.keys()
    for k in m_s:
        assert m_o[k] == pytest.approx(m_s[k], rel=metric_rel, abs=metric_abs), (k, m_o[k], m_s[k])


def assert_same_logs(logs_s, logs_o, *, steps, rel, abs_):
    """The per-step training logs (every key but the timings) of two `train()` runs."""
    assert len(logs_s) == len(logs_o) == steps
    for step, (s, o) in enumerate(zip(logs_s, logs_o, strict=True), start=1):
        assert o.keys() == s.keys(), (step, o.keys() ^ s.keys())
        for k in s.keys() - {"step_time"}:
            assert o[k] == pytest.approx(s[k], rel=rel, abs=abs_), (step, k, o[k], s[k])
