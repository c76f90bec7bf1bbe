"""grpo_lce/_dispatch.py: which path a call takes, and that importing grpo_lce works without
triton's tensor descriptors (an older triton) or without triton at all.

The import tests run in a subprocess that hides the module first (`sys.modules[name] = None`
makes `import name` fail), then compare a small call on CPU with grpo_lce.reference. Without
tensor descriptors the subprocess runs without TRITON_INTERPRET: triton 3.9's own interpreter
imports them, which an older triton's would not.
Run: python -m pytest tests/test_dispatch.py -q
"""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from grpo_lce import linear_cross_entropy, linear_logprobs
from grpo_lce._dispatch import decide, override, recording
from grpo_lce._head import HeadPass
from _head_inputs import head_inputs

DEV = "cuda" if torch.cuda.is_available() else "cpu"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _to(dev, *ts):
    return [None if t is None else t.to(dev) for t in ts]


@pytest.fixture
def triton_backend(monkeypatch):
    """The Triton backend (the interpreter on CPU); fused path and sync checks left to the
    environment, which starts at its defaults."""
    for name in ("GRPO_LCE_BACKEND", "GRPO_LCE_FUSED", "GRPO_LCE_SYNC_CHECKS"):
        monkeypatch.delenv(name, raising=False)
    with override(backend="triton"):
        yield


@pytest.mark.usefixtures("triton_backend")
def test_path_selection(monkeypatch):
    h, w, _, _ = head_inputs(8, 32, 300, torch.bfloat16, False, 0)
    h, w = _to(DEV, h, w)
    assert decide(h, w).fused
    assert not decide(h.float(), w.float()).fused  # fp32: the unfused loop
    assert not decide(h.half(), w.half()).fused  # fp16's exponent range (gemm_softmax docstring)
    h12, w12, _, _ = head_inputs(8, 12, 300, torch.bfloat16, False, 0)  # 24-byte rows: no TMA
    assert not decide(*_to(DEV, h12, w12)).fused
    # a pass that needs the entropy operand, β's term or a bias gradient runs unfused
    assert not HeadPass(ebasis=True).fusable
    assert not HeadPass(grad_bias=True).fusable
    assert not HeadPass(basis=True, beta=torch.zeros(8)).fusable
    assert HeadPass(basis=True, grad_weight=True, argmax=True, alpha=torch.ones(8)).fusable
    monkeypatch.setenv("GRPO_LCE_FUSED", "0")
    assert not decide(h, w).fused
    with override(fused=True):  # the seam beats the environment
        assert decide(h, w).fused
    monkeypatch.delenv("GRPO_LCE_FUSED")
    with override(fused=False):
        assert not decide(h, w).fused


@pytest.mark.usefixtures("triton_backend")
def test_row_layout_choice(monkeypatch):
    """Device-counted rows on the fused path unless a bias gets a gradient, the entropy basis is
    asked for, sync checks are on, or there are no rows; the count goes to the host only for a
    trainable weight."""
    h, w, b, _ = head_inputs(8, 32, 300, torch.bfloat16, True, 0)
    h, w, b = _to(DEV, h, w, b)
    p = decide(h, w, b)
    assert p.rows_on_device and not p.count_to_host and p.backend == "triton"
    assert decide(h, w.clone().requires_grad_(), b).count_to_host
    with torch.no_grad():  # no gradient, no count on the host
        assert not decide(h, w.clone().requires_grad_(), b).count_to_host
    p = decide(h, w, b.clone().requires_grad_())
    assert p.fused and not p.rows_on_device
    assert not decide(h, w, b, entropy_basis=True).rows_on_device
    assert not decide(h[:0], w, b).rows_on_device
    with override(sync_checks=True):
        assert not decide(h, w, b).rows_on_device
    monkeypatch.setenv("GRPO_LCE_SYNC_CHECKS", "1")
    assert not decide(h, w, b).rows_on_device
    with override(sync_checks=False):
        assert decide(h, w, b).rows_on_device


def test_backend_choice(monkeypatch):
    h, w = torch.randn(4, 8), torch.randn(10, 8)
    monkeypatch.delenv("GRPO_LCE_BACKEND", raising=False)
    assert decide(h, w).backend == ("triton" if h.is_cuda else "torch")  # auto
    monkeypatch.setenv("GRPO_LCE_BACKEND", "triton")
    assert decide(h, w).backend == "triton"
    with override(backend="torch"):
        assert decide(h, w).backend == "torch"
    monkeypatch.setenv("GRPO_LCE_BACKEND", "cuda")
    with pytest.raises(ValueError, match="GRPO_LCE_BACKEND must be auto, triton or torch"):
        decide(h, w)
    with pytest.raises(ValueError, match="backend must be one of"), override(backend="cuda"):
        pass


def test_recording_sees_each_call_once():
    h, w, _, y = head_inputs(12, 16, 50, torch.float32, False, 3)
    with recording() as rec:
        linear_logprobs(h, w, y)
        linear_cross_entropy(h, w, y)
    assert len(rec.paths) == 2
    with recording() as rec:
        pass
    linear_logprobs(h, w, y)  # outside the block: not recorded
    assert rec.paths == [] and rec.events == []


_CHECK = """
import sys
for name in {hidden!r}:
    sys.modules[name] = None  # `import name` now raises ImportError
import torch
import grpo_lce
from grpo_lce import _dispatch, linear_cross_entropy, linear_logprobs
from grpo_lce.reference import cross_entropy_ref, logprobs_ref
assert (_dispatch.HAS_TRITON, _dispatch.HAS_TMA) == {expect!r}, (
    _dispatch.HAS_TRITON, _dispatch.HAS_TMA)
g = torch.Generator().manual_seed(0)
h = torch.randn(37, 32, generator=g)
w = torch.randn(257, 32, generator=g) * 32 ** -0.5
y = torch.randint(0, 257, (37,), generator=g)
y[::5] = -100
for backend in {backends!r}:
    for dtype in (torch.float32, torch.bfloat16):
        hh, ww = h.to(dtype).clone().requires_grad_(), w.to(dtype)
        with _dispatch.override(backend=backend), _dispatch.recording() as rec:
            lp, ent = linear_logprobs(hh, ww, y, temperature=0.8, return_entropy=True)
            lp.sum().backward()
            loss = linear_cross_entropy(hh.detach(), ww, y)
        assert not any(p.fused for p in rec.paths), rec.paths
        h64 = hh.detach().double().requires_grad_()
        rl, re = logprobs_ref(h64, ww.double(), y, temperature=0.8)
        rl.sum().backward()
        rc = cross_entropy_ref(h64.detach(), ww.double(), y)
        # fp32 logits whatever the input dtype: fp32 rounding against fp64 (as test_logprobs)
        for name, a, b in (("logp", lp, rl), ("entropy", ent, re), ("CE", loss, rc)):
            err = (a.double() - b).abs().max().item()
            assert err < 5e-5, (backend, dtype, name, err)
        # dh in the input dtype: 2^-8 relative rounding in bf16 (GRAD_RTOL of test_logprobs)
        err = (hh.grad.double() - h64.grad).abs().max().item() / h64.grad.abs().max().item()
        assert err < (1e-4 if dtype == torch.float32 else 2e-2), (backend, dtype, "dh", err)
{extra}
print("ok")
"""

# bf16 operands that the fused kernel would take (the interpreter counts as a Hopper GPU)
_NOT_FUSED_WITHOUT_TMA = """
import os
os.environ["TRITON_INTERPRET"] = "1"  # (read per call by _dispatch; kernels stay compiled ones)
with _dispatch.override(backend="triton"):
    assert not _dispatch.decide(h.bfloat16(), w.bfloat16()).fused
"""

_TRITON_BACKEND_IS_AN_ERROR = """
try:
    with _dispatch.override(backend="triton"):
        linear_logprobs(h, w, y)
except RuntimeError as e:
    assert "but triton is not installed" in str(e), e
else:
    raise AssertionError("the triton backend without triton must raise")
"""


def _run_hidden(hidden: tuple, expect: tuple, backends: tuple, extra: str) -> None:
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("TRITON_INTERPRET", None)
    env.pop("GRPO_LCE_BACKEND", None)
    code = _CHECK.format(hidden=hidden, expect=expect, backends=backends, extra=extra)
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


@pytest.mark.slow  # a fresh interpreter; test_import_without_triton stays in the default suite
def test_import_without_tensor_descriptors():
    """A triton without `triton.tools.tensor_descriptor` (older versions): importing works, the
    fused path is off even where it would otherwise run, the torch path gives exact results."""
    _run_hidden(("triton.tools.tensor_descriptor",), (True, False), ("torch",),
                _NOT_FUSED_WITHOUT_TMA)


def test_import_without_triton():
    """No triton at all: importing works, the torch path gives exact results (forward and
    backward), and asking for the Triton backend is a clear error."""
    _run_hidden(("triton",), (False, False), ("torch",), _TRITON_BACKEND_IS_AN_ERROR)

