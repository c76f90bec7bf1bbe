"""kernels.pdl: where the decode kernels launch with programmatic dependent launch, and what a
launch passes. The GPU side (the same tokens with and without PDL, every kernel launched with
it) is tests/test_sampling_loop.py's test_gpu_pdl_launches_change_no_token; the kernels'
griddepcontrol instructions compile in tests/_compile_decode_kernels.py."""

import inspect

import pytest
import torch

from trainers.sampling import decode_attention
from trainers.sampling.kernels import head_logits, linear4bit, pdl, race, rmsnorm, rope

KERNELS = [linear4bit._linear4bit_lora_kernel, rmsnorm._add_rmsnorm_kernel,
           rope._rope_cache_kernel, decode_attention._decode_attention_split_kernel,
           decode_attention._rope_attention_kernel,
           head_logits._head_logits_kernel, race._chunk_lse_kernel, race._chunk_race_kernel,
           race._pick_kernel]


def test_off_on_the_cpu_and_under_the_interpreter(monkeypatch):
    pdl.LAUNCHES.clear()
    with pdl.decode_step():
        assert pdl.pdl_reason(torch.device("cpu")) == "device cpu"
        assert pdl.launch_args(rmsnorm._add_rmsnorm_kernel, torch.device("cpu")) == {"PDL": False}
        monkeypatch.setattr(pdl, "interpreting", lambda: True)
        assert pdl.pdl_reason(torch.device("cuda", 0)) == "Triton's interpreter"
    assert not pdl.LAUNCHES


def test_environment_turns_it_off(monkeypatch):
    monkeypatch.setenv(pdl.ENV, "0")
    assert pdl.pdl_reason(torch.device("cuda", 0)) == f"{pdl.ENV}=0"


def test_on_where_the_device_and_launcher_take_it(monkeypatch):
    """With the interpreter off, a device that supports it and inside a decode step (only
    there), a launch gets both the constexpr and Triton's option, and is counted."""
    monkeypatch.setenv(pdl.ENV, "1")
    monkeypatch.setattr(pdl, "interpreting", lambda: False)
    monkeypatch.setattr(pdl, "_device_supports", lambda index: None)
    pdl.LAUNCHES.clear()
    dev = torch.device("cuda", 0)
    assert pdl.pdl_reason(dev) == "outside a decode step"
    assert pdl.launch_args(rope._rope_cache_kernel, dev) == {"PDL": False}
    with pdl.decode_step():
        args = pdl.launch_args(rope._rope_cache_kernel, dev)
        assert args == {"PDL": True, "launch_pdl": True}
        assert pdl.LAUNCHES == {"_rope_cache_kernel": 1}
        monkeypatch.setattr(pdl, "_device_supports", lambda index: "compute capability 8.0")
        assert pdl.pdl_reason(dev) == "compute capability 8.0"
        assert pdl.launch_args(rope._rope_cache_kernel, dev) == {"PDL": False}
    assert pdl.pdl_reason(dev) == "outside a decode step"


@pytest.mark.parametrize("kernel", KERNELS, ids=lambda k: k.__name__)
def test_every_decode_kernel_calls_grid_wait(kernel):
    """Each kernel takes the PDL constexpr and calls grid_wait once on its path (the rule of
    kernels.pdl: every program waits, so completion passes down the chain); what it loads
    before the wait is checked in the compiled PTX (tests/_compile_decode_kernels.py)."""
    assert "PDL" in kernel.arg_names
    src = inspect.getsource(kernel.fn)
    if kernel is linear4bit._linear4bit_lora_kernel:  # the register tile waits in its K loop
        src += inspect.getsource(linear4bit._reg_tile_loop.fn)
        assert src.count("grid_wait(PDL)") == 3  # the register tile's, the block loop's two
    else:
        assert src.count("grid_wait(PDL)") == 1


def test_the_linear_lets_the_next_kernel_start_early_only_in_one_round(monkeypatch):
    """`_early_next`: launched with PDL, on the register tile, and only while the grid fits
    PROGRAMS_PER_SM programs a SM at once."""
    monkeypatch.setattr(linear4bit, "_num_sms", lambda device: 132)
    dev = torch.device("cuda", 0)
    slots = linear4bit.PROGRAMS_PER_SM * 132
    assert linear4bit._early_next(True, True, (1, slots // 4, 4), dev)
    assert not linear4bit._early_next(True, True, (1, slots // 4 + 1, 4), dev)
    assert not linear4bit._early_next(True, False, (1, 8, 1), dev)  # the block loop: never
    monkeypatch.setattr(pdl, "EARLY_NEXT_WAVES", 0)
    assert not linear4bit._early_next(True, True, (1, 8, 1), dev)
    monkeypatch.setattr(pdl, "EARLY_NEXT_WAVES", 1)
    assert not linear4bit._early_next(False, True, (1, 8, 1), dev)  # launched without PDL
    src = inspect.getsource(linear4bit._linear4bit_lora_kernel.fn)
    assert src.count("let_next_launch(EARLY_NEXT)") == 1


SMALL = [rmsnorm._add_rmsnorm_kernel, decode_attention._decode_attention_split_kernel,
         decode_attention._rope_attention_kernel]


def test_small_kernels_let_the_next_launch_at_their_start(monkeypatch):
    """`next_at_start`: add_rmsnorm and the decode attention let the next kernel launch at their
    start only when they launch with PDL and SMALL_NEXT_AT_START; the trigger is their first
    statement, before their wait; no other decode kernel has it (the linear's is `_early_next`'s,
    after its K loop)."""
    on, off = {"PDL": True, "launch_pdl": True}, {"PDL": False}
    assert pdl.next_at_start(on) == {**on, "NEXT_AT_START": True}
    assert pdl.next_at_start(off) == {**off, "NEXT_AT_START": False}
    monkeypatch.setattr(pdl, "SMALL_NEXT_AT_START", False)
    assert pdl.next_at_start(on) == {**on, "NEXT_AT_START": False}
    for kernel in KERNELS:
        src = inspect.getsource(kernel.fn)
        if kernel in SMALL:
            assert "NEXT_AT_START" in kernel.arg_names
            body = src[src.index("):\n"):]
            first = src.index("let_next_launch(NEXT_AT_START)")
            assert first < src.index("grid_wait(PDL)"), kernel.__name__
            assert body.count("let_next_launch") == 1
        else:
            assert "NEXT_AT_START" not in kernel.arg_names
    for launcher, kernel in ((rmsnorm.add_rmsnorm, "_add_rmsnorm_kernel"),
                             (decode_attention.decode_attention, "_decode_attention_split_kernel"),
                             (decode_attention.rope_attention, "_rope_attention_kernel")):
        assert f"next_at_start(launch_args({kernel}," in inspect.getsource(launcher)
