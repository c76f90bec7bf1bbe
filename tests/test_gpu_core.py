"""grpo_lce at Llama scale on a CUDA GPU (H100/H200): values, gradients, memory.

Marked `gpu`; skipped without CUDA. Run on the GPU machine:
    python -m pytest tests/test_gpu_core.py -m gpu -q
Llama-3.2-1B head: N = 8192 tokens, H = 2048, V = 128256, bf16.
"""

import pytest
import torch

from grpo_lce import chunked_linear, linear_cross_entropy, linear_logprobs
from grpo_lce._chunks import DEFAULT_CHUNK_BUDGET_BYTES
from grpo_lce._dispatch import recording
from grpo_lce.reference import cross_entropy_ref, logprobs_ref
from _tolerance import assert_3way, assert_close_scaled

pytestmark = pytest.mark.gpu
N, H, V = 8192, 2048, 128256
SLICE = 512  # rows checked against fp64 (per-row quantities: exact on any slice)


def _inputs(dtype=torch.bfloat16, n_ignored=0, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    h = torch.randn(N, H, device="cuda", generator=g).to(dtype)
    w = (torch.randn(V, H, device="cuda", generator=g) * 0.02).to(dtype)  # Llama-like init
    h = h * 2.0  # logits of std ~2.5: a realistic, peaked softmax
    y = torch.randint(0, V, (N,), device="cuda", generator=g)
    if n_ignored:
        y[torch.randperm(N, device="cuda", generator=g)[:n_ignored]] = -100
    return h, w, y


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_llama_scale_logprobs_values_and_grads(dtype):
    h, w, y = _inputs(dtype, n_ignored=N // 4)
    h.requires_grad_()
    logp, ent = linear_logprobs(h, w, y, temperature=0.7, return_entropy=True)
    g = torch.randn(N, device="cuda")
    ge = torch.randn(N, device="cuda")
    (logp * g + ent * ge).sum().backward()

    hs = h.detach()[:SLICE].double().requires_grad_()
    rl, re = logprobs_ref(hs, w, y[:SLICE], temperature=0.7)
    (rl * g[:SLICE].double() + re * ge[:SLICE].double()).sum().backward()
    # DESIGN target: max |logp error| <= 1e-4 at Llama scale (bf16-logit paths: ~7e-3)
    assert_3way(logp[:SLICE], None, rl, k=0, atol=1e-4, what="logp")
    assert_3way(ent[:SLICE], None, re, k=0, atol=1e-4, what="entropy")
    # dh is returned in the input dtype: 2^-8 (bf16) relative rounding, bf16 operand G
    assert_close_scaled(h.grad[:SLICE], hs.grad, rtol=1e-2, what="d hidden")


def test_trainable_head_and_cross_entropy_grads():
    n = 1024  # dW sums over rows: keep the fp64 reference (V, H) affordable
    h, w, y = _inputs()
    h, y = h[:n].clone().requires_grad_(), y[:n].clone()
    y[::7] = -100
    w = w.clone().requires_grad_()
    loss, m = linear_cross_entropy(h, w, y, return_metrics=True)
    loss.backward()
    h64, w64 = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ref = cross_entropy_ref(h64, w64, y)
    ref.backward()
    assert_3way(loss, None, ref, k=0, atol=1e-4, what="CE mean")
    assert_close_scaled(h.grad, h64.grad, rtol=1e-2, what="CE d hidden")
    assert_close_scaled(w.grad, w64.grad, rtol=1e-2, what="CE d weight")

    hg, wg = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    gl = torch.randn(n, device="cuda")
    lp = linear_logprobs(hg, wg, y)
    (lp * gl).sum().backward()
    wr = w64.detach().clone().requires_grad_()
    hr = h64.detach().clone().requires_grad_()
    rl, _ = logprobs_ref(hr, wr, y)
    (rl * gl.double()).sum().backward()
    assert_close_scaled(wg.grad, wr.grad, rtol=1e-2, what="logp d weight (recompute path)")
    assert_close_scaled(hg.grad, hr.grad, rtol=1e-2, what="logp d hidden (recompute path)")


def test_peak_memory_within_chunk_budget():
    h, w, y = _inputs()
    h.requires_grad_()
    g = torch.randn(N, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    logp = linear_logprobs(h, w, y)
    (logp * g).sum().backward()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    # chunk budget + the rows gathered valid-first (N, H) bf16 (grpo_lce/_rows.py), which the
    # basis's bf16 half overwrites, + its (N, H) uint8 half (grpo_lce/_head.py) + dh
    # (N, H) bf16 + per-row vectors, GEMM 2's split partials + 32 MiB slack
    bound = DEFAULT_CHUNK_BUDGET_BYTES + N * H * (2 + 1 + 2) + 32 * 2**20
    assert extra <= bound, f"extra peak {extra / 2**20:.0f} MiB > bound {bound / 2**20:.0f} MiB"
    assert extra <= 512 * 2**20, f"extra peak {extra / 2**20:.0f} MiB > 512 MiB target"
    assert logp.isfinite().all()


def test_chunked_linear_on_gpu():
    h, w, y = _inputs()
    h = h[:300].clone().requires_grad_()
    out = chunked_linear(
        lambda z, t: torch.nn.functional.cross_entropy(z, t, reduction="none"), h, w, y[:300],
        chunk_size=128,
    )
    out.sum().backward()
    h64 = h.detach().double().requires_grad_()
    ref = torch.nn.functional.cross_entropy(h64 @ w.double().t(), y[:300], reduction="none")
    ref.sum().backward()
    assert_3way(out, None, ref, k=0, atol=1e-4, what="chunked CE")
    assert_close_scaled(h.grad, h64.grad, rtol=1e-2, what="chunked d hidden")


def test_bad_target_on_gpu_is_a_deferred_error_not_a_crash(monkeypatch):
    """The fused path checks targets without a host sync (grpo_lce/_checks.py): the bad row
    is NaN, the others exact, and a later call raises; GRPO_LCE_SYNC_CHECKS=1 (the environment
    switch itself, read by grpo_lce/_dispatch.py) and the unfused (fp16) path raise in the call
    itself."""
    monkeypatch.delenv("GRPO_LCE_SYNC_CHECKS", raising=False)
    h, w, y = _inputs(n_ignored=100)
    y = y.clone()
    y[5] = V + 3
    ok = linear_logprobs(h, w, torch.where(torch.arange(N, device="cuda") == 5, 0, y))
    lp = linear_logprobs(h, w, y)
    assert torch.isnan(lp[5])
    others = torch.arange(N, device="cuda") != 5
    torch.testing.assert_close(lp[others], ok[others], rtol=0, atol=0)
    torch.cuda.synchronize()  # the flag has reached the host: the next call reports it
    with pytest.raises(ValueError, match="targets contained a value outside"):
        linear_logprobs(h[:4], w, y[:4].clamp_min(0))
    linear_logprobs(h[:4], w, y[:4].clamp_min(0))  # reported once
    with pytest.raises(ValueError, match="targets contains"):
        linear_logprobs(h.half(), w.half(), y)
    monkeypatch.setenv("GRPO_LCE_SYNC_CHECKS", "1")
    with pytest.raises(ValueError, match="labels contains"):
        linear_cross_entropy(h, w, y)


def test_no_host_sync_on_the_fused_path():
    """bf16 on Hopper, frozen head, ignored rows: log-probs (+ entropy) and CE (+ metrics),
    forward and backward, with CUDA's sync debug mode set to raise on any synchronisation."""
    h, w, y = _inputs(n_ignored=N // 3)
    h.requires_grad_()
    g = torch.randn(N, device="cuda")

    def step():
        lp, ent = linear_logprobs(h, w, y, temperature=0.9, return_entropy=True)
        (lp * g).sum().backward()
        loss, m = linear_cross_entropy(h, w, y, return_metrics=True, num_items=1000)
        loss.backward()
        return lp, ent, loss, m

    step()  # compile the kernels and fill the allocators' caches first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        lp, ent, loss, m = step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert lp.isfinite().all() and loss.isfinite() and int(m["num_tokens"]) == N - N // 3


def test_trainable_head_waits_only_on_an_event():
    """Trainable W, ignored rows: CE and log-probs forward and backward under CUDA's sync debug
    mode set to raise. The one host read of the row count (_rows.HostCount) is an event
    wait, which that mode does not count, issued after chunk 0's GEMM 1 (test_device_rows checks
    the order); anything else that synchronised (.item(), .tolist(), nonzero) would raise."""
    h, w, y = _inputs(n_ignored=N // 3)
    h.requires_grad_()
    w = w.clone().requires_grad_()
    g = torch.randn(N, device="cuda")

    def step():
        lp = linear_logprobs(h, w, y, temperature=0.9)
        (lp * g).sum().backward()
        loss, m = linear_cross_entropy(h, w, y, return_metrics=True)
        loss.backward()
        return lp, loss, m

    step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with recording() as rec:
            lp, loss, m = step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    reads = [1 for _ in rec.of("count read")]
    assert reads == [1, 1]  # the log-probs' backward, the CE's forward
    assert lp.isfinite().all() and loss.isfinite() and int(m["num_tokens"]) == N - N // 3
    assert w.grad.isfinite().all()


@pytest.mark.parametrize("fused", ["1", "0"], ids=["fused", "unfused"])
def test_far_targets_and_both_paths_at_scale(fused, dispatch_override):
    """Rows whose target has log p < -66 take the fused path's exact fallback (kernels/
    gemm_softmax.py); both paths agree with fp64 on them and on ordinary rows, frozen and
    trainable head."""
    dispatch_override(fused=fused == "1")
    n = 512
    h, w, y = _inputs()
    h, y = h[:n].clone(), y[:n].clone()
    h[: n // 2] *= 40  # logits of std ~100 on half the rows ...
    z = (h[: n // 2].float() @ w.float().t())
    y[: n // 2 : 2] = z[::2].argmin(1)  # ... and the least likely token as target on a quarter
    h.requires_grad_()
    wt = w.clone().requires_grad_()
    g = torch.randn(n, device="cuda")
    lp = linear_logprobs(h, wt, y)
    (lp * g).sum().backward()
    h64, w64 = h.detach().double().requires_grad_(), w.double().requires_grad_()
    rl, _ = logprobs_ref(h64, w64, y)
    (rl * g.double()).sum().backward()
    assert rl[: n // 2 : 2].max() < -66  # the fallback's rows exist
    # fp32 logits of magnitude ~700 here: an H-term fp32 dot is ~1e-6..1e-5 relative of that
    assert_3way(lp, None, rl, k=0, atol=1e-4 + 1e-5 * rl.abs().max().item(), what="logp")
    assert_close_scaled(h.grad, h64.grad, rtol=1e-2, what="d hidden")
    assert_close_scaled(wt.grad, w64.grad, rtol=1e-2, what="d weight")
    hf = h.detach().clone().requires_grad_()
    (linear_logprobs(hf, w, y) * g).sum().backward()
    assert_close_scaled(hf.grad, h64.grad, rtol=1e-2, what="d hidden, frozen head")
