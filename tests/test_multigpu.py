"""tests/test_ddp.py on two GPUs: 2 processes (nccl, rank r on cuda:r) against 1 process on a GPU.

The same scenarios and the same checks as the CPU test, run where the collectives are NCCL's
and the head runs the Triton kernels: trainers.GRPOTrainer (loss_type dapo and grpo, LoRA),
trainers.SFTTrainer, DPOTrainer, KTOTrainer, RLOOTrainer and DistillationTrainer (LoRA;
tests/_ddp_trainers.py) under DDP, trainers.GRPOTrainer (dapo) under FSDP2 (`fully_shard` on
a CUDA mesh) with a trainable tied head (a DTensor gathered by trainers.sharded, its gradient
reduce-scattered) and with LoRA, SFT, DPO, KTO, RLOO and distillation (LoRA) under FSDP2 (the
policy sharded; distillation's teacher whole, and sharded too), and, if deepspeed is installed,
GRPO, SFT, DPO, KTO, RLOO and distillation under DeepSpeed ZeRO-3 with LoRA (frozen head,
partitioned and gathered; the teacher on its own ZeRO-3 engine; a trainable head refused at
construction); and GRPO (dapo), SFT, DPO, KTO, RLOO and distillation on bitsandbytes NF4 bases
(compute dtype fp32) with LoRA under DDP (tests/_ddp_nf4.py: quantized once on the reference's
GPU and loaded by both sides; the fp64 truth is the dequantized twin's step, which the reference
writes); and GRPO under DDP sampling through each rank's own decode loop (CUDA graphs captured
per rank) in TRL's `_generate_and_score_completions` (tests/_ddp_fastgen.py). Tiny fp32 models:
this checks the synchronisation, not scale. Needs 2 visible GPUs,
else skipped.

    python -m pytest tests/test_multigpu.py -m gpu -q -rA

Three subprocesses of tests/_ddp_worker.py, one after the other: `--reference` on the first
visible GPU alone (CUDA_VISIBLE_DEVICES narrowed to it), which writes the global batches and
the single-process losses and gradients; the 2 ranks on the two GPUs; then
`--fastgen-reference` on the first GPU alone, which scores the global batch the ranks sampled
in grpo_fastgen (the function the CPU test calls in-process; it needs the ranks' samples, so
it runs after them, and on the reference's GPU, so that the tolerance's scale, the single
process's distance to fp64, is the GPU's). All are separate processes so that this pytest
process never initialises CUDA or accelerate's singleton state, and all turn TF32 off
(`_exact_fp32`): fp32 GEMMs in full fp32, cuDNN deterministic.

Tolerances: tests/test_ddp.py's, for the same reason. fp32 on both sides, identical weights,
different row groupings (2 rows per rank against 4) and a reduction across ranks: only the
summation order differs (cuBLAS may also pick another kernel, e.g. split-K, for another M),
which in fp32 is ~1e-7 relative per sum; rtol 1e-5 on losses, 1e-4 × max|grad| on gradients,
and the gathered entropy metric to rel 1e-5. The checks that the all-reduce happened (bitwise
equal synced gradients on both ranks, local ones off by > 1e-2 × max|grad|) carry over as is.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
import test_ddp as cpu  # the CPU test: its checks are applied to the GPU results

pytestmark = [
    pytest.mark.gpu,  # skipped without CUDA (conftest); and below, with fewer than two GPUs
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"),
]

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(REPO, "tests", "_ddp_worker.py")
TIMEOUT_S = 180  # per subprocess; each takes ~10-20 s (imports, CUDA and NCCL start-up)


def _worker(args: list[str], env: dict) -> float:
    """Run the worker with `args`; its whole process group is killed on a timeout (spawned ranks
    stuck in a collective would otherwise outlive it). Returns the wall time in s."""
    t0 = time.time()
    proc = subprocess.Popen([sys.executable, WORKER, *args], env=env, cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log, _ = proc.communicate()
        pytest.fail(f"worker {args} timed out after {TIMEOUT_S} s:\n{log[-4000:]}")
    assert proc.returncode == 0, f"worker {args} failed (rc {proc.returncode}):\n{log[-6000:]}"
    return time.time() - t0


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(single-process reference results on one GPU, [rank 0 results, rank 1 results])."""
    out = tmp_path_factory.mktemp("multigpu")
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
              "MASTER_PORT", "TRITON_INTERPRET"):
        env.pop(k, None)
    first_gpu = env.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
    t_ref = _worker(["--reference", "--device", "cuda", "--nprocs", str(cpu.WORLD),
                     "--out", str(out)], {**env, "CUDA_VISIBLE_DEVICES": first_gpu})
    scenarios = (f"{cpu.SCENARIOS},{cpu.FASTGEN_SCENARIO},{cpu.TRAINER_SCENARIOS},"
                 f"{cpu.NF4_SCENARIO}")
    t_ddp = _worker(["--device", "cuda", "--nprocs", str(cpu.WORLD), "--out", str(out),
                     "--port", str(cpu._free_port()), "--scenarios", scenarios], env)
    # grpo_fastgen's reference scores what the ranks sampled: a second pass after them
    t_fg = _worker(["--fastgen-reference", "--device", "cuda", "--nprocs", str(cpu.WORLD),
                    "--out", str(out)], {**env, "CUDA_VISIBLE_DEVICES": first_gpu})
    print(f"reference on 1 GPU: {t_ref:.1f} s; {cpu.WORLD} ranks on {cpu.WORLD} GPUs: "
          f"{t_ddp:.1f} s; grpo_fastgen reference: {t_fg:.1f} s")
    ref = torch.load(out / "ref.pt", weights_only=False)
    ref.update(torch.load(out / "ref_fastgen.pt", weights_only=False))
    ranks = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(cpu.WORLD)]
    return ref, ranks


def test_placement(runs):
    """The runs really were on the GPUs: reference on cuda:0 without a process group, rank r
    on cuda:r over NCCL."""
    ref, ranks = runs
    assert ref["meta"] == {"device": "cuda:0", "backend": None}, ref["meta"]
    for r, rk in enumerate(ranks):
        assert rk["meta"] == {"device": f"cuda:{r}", "backend": "nccl"}, (r, rk["meta"])


@pytest.mark.parametrize("case", ["grpo_dapo", "grpo_grpo", "sft"])
def test_ddp_matches_single_process_gpu(runs, case):
    cpu.test_ddp_matches_single_process(runs, case)


@pytest.mark.parametrize("loss_type", cpu.W.LOSS_TYPES)
def test_grpo_fastgen_matches_single_process_gpu(runs, loss_type):
    cpu.test_grpo_fastgen_matches_single_process(runs, loss_type)


def test_grpo_fastgen_each_rank_sampled_with_its_loop_gpu(runs):
    """Each rank's own decode loop captured its CUDA graphs and served its generation, with no
    rank waiting on the other's capture beyond cpu.WAIT_BOUND_S (`cpu.check_fastgen_sampling`)."""
    cpu.check_fastgen_sampling(runs[1], captured=True)


@pytest.mark.parametrize("case", cpu.T.NAMES)
def test_trainer_ddp_matches_single_process_gpu(runs, case):
    cpu.test_trainer_ddp_matches_single_process(runs, case)


@pytest.mark.parametrize("case", cpu.N.CASES)
def test_nf4_ddp_matches_single_process_gpu(runs, case):
    cpu.test_nf4_ddp_matches_single_process(runs, case)


@pytest.mark.parametrize("case", ["fsdp2_full", "fsdp2_lora"])
def test_fsdp2_matches_single_process_gpu(runs, case):
    cpu.test_fsdp2_matches_single_process(runs, case)


@pytest.mark.parametrize("case", list(cpu.FSDP2_TRAINER_CASES))
def test_trainer_fsdp2_matches_single_process_gpu(runs, case):
    cpu.test_trainer_fsdp2_matches_single_process(runs, case)


def test_zero3_matches_single_process_gpu(runs):
    cpu.test_zero3_matches_single_process(runs)  # skips without deepspeed


@pytest.mark.parametrize("case", cpu.ZERO3_TRAINER_CASES)
def test_trainer_zero3_matches_single_process_gpu(runs, case):
    cpu.test_trainer_zero3_matches_single_process(runs, case)  # skips without deepspeed


def test_zero3_trainable_head_refused_at_construction_gpu(runs):
    cpu.test_zero3_trainable_head_refused_at_construction(runs)  # skips without deepspeed
