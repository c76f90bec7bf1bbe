"""bench.decode_linear's pure read (the least a launch that reads a linear's bytes costs): the
kernel reads every word of its range exactly once, whatever the programs and block, on the GPU
where there is one, else in Triton's interpreter (the timing itself needs a GPU)."""

import itertools

import pytest
import torch

from bench import decode_linear as dl

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _xor(t: torch.Tensor) -> int:
    acc = 0
    for v in t.tolist():
        acc ^= v
    return acc


@pytest.mark.parametrize("words,programs,block,warps", [
    (1, 1, 64, 4), (63, 1, 64, 2), (64, 2, 64, 4), (1000, 3, 64, 2), (4099, 4, 256, 4),
    (5, 4, 64, 4)])
def test_read_words_reads_each_word_once(words, programs, block, warps):
    g = torch.Generator().manual_seed(words)
    src = torch.randint(-2**31, 2**31 - 1, (words + 37,), dtype=torch.int32, generator=g)
    out = torch.full((programs,), 12345, dtype=torch.int32, device=DEVICE)
    dl.read_words(src.to(DEVICE), out, words, block, warps)
    # a word read twice cancels and one never read is missing: either changes the XOR
    assert _xor(out.cpu()) == _xor(src[:words])


def test_read_calls_cycle_through_slices_past_twice_the_l2():
    l2, _ = dl.l2_and_sms(DEVICE)
    calls = dl.read_calls(DEVICE, 1000, 2, 64, 2)
    assert len(calls) == min(1024, -(-2 * l2 // 1000))
    assert all(c.args[2] == 250 and c.args[0].numel() >= 250 for c in calls)
    starts = [c.args[0].data_ptr() for c in calls]
    assert len(set(starts)) == len(calls)  # no slice read twice in one pass over the calls
    assert len(calls) * 1000 >= 2 * l2 or len(calls) == 1024  # a pass reads 2 L2s (or the cap)
    assert all((b - a) % 512 == 0 for a, b in itertools.pairwise(starts))
    calls[0]()
    calls[-1]()


def test_fixed_and_rate_recovers_a_line():
    # 2 µs + bytes at 3000 GB/s
    pts = [(b, 2e-3 + b / 3e12 * 1e3) for b in (2**20, 2**22, 2**25)]
    fixed, rate = dl.fixed_and_rate(pts)
    assert fixed == pytest.approx(2.0, rel=1e-9)
    assert rate == pytest.approx(3000.0, rel=1e-9)
    assert dl.fixed_and_rate(pts[:1]) is None
    assert dl.fixed_and_rate([(1, 2.0), (2, 1.0)]) is None


@pytest.mark.skipif(DEVICE.type == "cuda", reason="the CPU's answer")
def test_read_floor_and_sweep_are_empty_off_cuda():
    cpu = torch.device("cpu")
    assert dl.read_floor(cpu, 1000) == {}
    assert dl.read_sweep(cpu) == {}
