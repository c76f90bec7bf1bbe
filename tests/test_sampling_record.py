"""trainers.sampling.kernels.record: the decode step's bookkeeping in one launch, against the
torch ops it replaces (`record_step_torch`), bit for bit: integer and copy operations have one
right answer. CPU: Triton's interpreter; `-m gpu`: compiled.

    python -m pytest -q tests/test_sampling_record.py
"""

import pytest
import torch

from trainers.sampling.kernels.record import record_step, record_step_torch


def _state(B, R, W, E, seed, device):
    """A step's inputs: some rows finished, some drawing an EOS id, the step mid-way, and
    (with R > B) a bucket's rows, a permutation into R original rows."""
    g = torch.Generator().manual_seed(seed)
    eos = torch.randperm(50, generator=g)[:E] + 3
    y = torch.randint(0, 60, (B,), generator=g)
    hit = torch.rand(B, generator=g) < 0.3
    y[hit] = eos[torch.randint(0, E, (int(hit.sum()),), generator=g)]
    st = {
        "y": y,
        "lp": -torch.rand(B, generator=g) * 5,
        "done": torch.rand(B, generator=g) < 0.4,
        "eos": eos,
        "out": torch.randint(0, 60, (R, W), generator=g),
        "logp": torch.randn(R, W, generator=g),
        "step": torch.tensor([int(torch.randint(0, W, (1,), generator=g))]),
        "slot": torch.randint(5, 40, (B,), generator=g),
        "cur": torch.randint(0, 60, (B,), generator=g),
    }
    if B > 1:  # both kinds of row at every batch
        st["done"][0], st["done"][-1] = False, True
    rows = torch.randperm(R, generator=g)[:B] if R > B else None
    return {k: v.to(device) for k, v in st.items()}, None if rows is None else rows.to(device)


ORDER = ("y", "lp", "done", "eos", "pad", "out", "logp", "step", "slot", "cur", "rows")


def _run(fn, st, rows, pad):
    st = {k: v.clone() for k, v in st.items()}
    args = {**st, "pad": pad, "rows": None if rows is None else rows.clone()}
    fn(*(args[k] for k in ORDER))
    return st


@pytest.mark.parametrize("B,R,E,pad", [(1, 1, 1, 0), (5, 5, 3, "eos"), (8, 13, 2, 2),
                                       (37, 37, 1, "eos"), (64, 64, 4, 0), (100, 256, 3, 1)])
def test_record_matches_the_torch_ops(B, R, E, pad, device="cpu"):
    """Every output tensor equal to the torch ops' (out, logp, done, slot, cur, step), with
    and without a bucket's rows, pad an EOS id ("eos": a finished row's padding ends it
    again) or not (ids 0..2 are never EOS here)."""
    W = 17
    st, rows = _state(B, R, W, E, seed=B * 31 + R, device=device)
    pad = int(st["eos"][0]) if pad == "eos" else pad
    ref = _run(record_step_torch, st, rows, pad)
    got = _run(record_step, st, rows, pad)
    for k in ("out", "logp", "done", "slot", "cur", "step"):
        assert got[k].dtype == ref[k].dtype and torch.equal(got[k], ref[k]), k
    # the step really moved what it should: a live row's slot advanced, step by one
    live = ~st["done"]
    assert torch.equal(got["slot"][live], st["slot"][live] + 1)
    assert int(got["step"]) == int(st["step"]) + 1


def test_bad_inputs_name_the_argument():
    st, _ = _state(4, 4, 5, 2, seed=0, device="cpu")
    args = {**st, "pad": 0, "rows": None}
    args["slot"] = args["slot"].int()
    with pytest.raises(ValueError, match="slot is"):
        record_step(*(args[k] for k in ORDER))
    args = {**st, "pad": 0, "rows": None, "logp": st["logp"][:, :3]}
    with pytest.raises(ValueError, match="out .* and logp"):
        record_step(*(args[k] for k in ORDER))
    args = {**st, "pad": 0, "rows": None, "eos": st["eos"][:0]}
    with pytest.raises(ValueError, match="eos 0 ids"):
        record_step(*(args[k] for k in ORDER))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("B,R,E,pad", [(8, 8, 2, 0), (64, 128, 3, "eos"), (256, 256, 1, 1)])
def test_gpu(B, R, E, pad):
    """Compiled, at decode batches, a bucket's rows and a full batch."""
    test_record_matches_the_torch_ops(B, R, E, pad, "cuda")
