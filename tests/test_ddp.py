"""The trainers under data parallelism: 2 CPU processes (gloo) against 1 process, same global batch.

Covers trainers.GRPOTrainer (loss_type dapo and grpo, LoRA), trainers.SFTTrainer (LoRA,
num_items_in_batch), and trainers.DPOTrainer (sigmoid, the disabled adapter as reference),
KTOTrainer (with its KL pass), RLOOTrainer and DistillationTrainer (LoRA student, a tiny
teacher) under DDP (tests/_ddp_trainers.py has those four's models and batches); and
trainers.GRPOTrainer under FSDP2 (`fully_shard`, laid out as accelerate does it) with a
trainable tied head (the LM head is a DTensor that `trainers.sharded` gathers, its gradient
reduce-scattered back) and with LoRA; SFTTrainer, DPOTrainer, KTOTrainer, RLOOTrainer and
DistillationTrainer (LoRA, frozen head) under FSDP2 too (the policy sharded, so are DPO's
disabled-adapter and KTO's "ref"-adapter references, which are the same model; distillation's
teacher whole, as TRL + accelerate leave it under FSDP2, and also sharded); GRPOTrainer, and
SFT, DPO, KTO, RLOO and distillation, under DeepSpeed ZeRO-3 with LoRA (frozen head,
partitioned and gathered; the references again adapters of the policy; distillation's teacher
on its own ZeRO-3 engine, as TRL's `prepare_deepspeed` builds it; if deepspeed is installed);
GRPO (dapo), SFT, DPO, KTO, RLOO and distillation on bitsandbytes NF4 bases with LoRA under DDP
(tests/_ddp_nf4.py: the bases quantized once, the fp64 truth the dequantized twin's step); plus
the refusals in `check_parallelism` (ZeRO-3 with a trainable head among them); and GRPO with
fast generation under DDP (tests/_ddp_fastgen.py): each rank samples its share of the
generation batch through its own decode loop inside TRL's `_generate_and_score_completions`,
and the DDP step on those samples is checked against one process on the global batch the
ranks' samples form (computed after the ranks, which must sample first), plus a bound on how
long a rank's first generation takes beyond its own graph captures (WAIT_BOUND_S). One subprocess
(tests/_ddp_worker.py) spawns both ranks and runs every scenario, so the ~10 s of imports and
rendezvous are paid once. (The first ZeRO-3
run on a machine also JIT-builds DeepSpeed's CPU shared-memory comm op, ~25 s, cached in
~/.cache/torch_extensions.) The same on two GPUs over NCCL: tests/test_multigpu.py.

    python -m pytest tests/test_ddp.py -q

Why the two runs must agree. Rank r gets rows [r·B/2, (r+1)·B/2) of the global batch and the
global `num_items_in_batch` N (TRL gathers it over processes). DDP averages gradients over
the P ranks. dapo: loss_r = Σ_{rows of r} ℓ / (N / P), so (1/P) Σ_r loss_r = Σ ℓ / N, the
single-process loss, and likewise the averaged gradient. grpo: loss_r = mean over r's rows
of the per-row mean, and with equal rows per rank the mean of means is the global mean. SFT:
loss_r = Σ_r nll / N × P (`average_tokens_across_devices`), same argument. (bnpo and dr_grpo
divide by per-rank quantities, so their DDP loss is by definition not the global-batch one.)
TRL 1.16's definitions for the other four, each rank holding B/2 of the B pairs / examples /
rows (accelerate's even batches):
  DPO (sigmoid)  loss_r = mean over r's pairs of −log σ(β Δ_pair); each pair (chosen and
                 rejected rows, both reference passes) lies on one rank: the mean of means.
  KTO            loss_r = mean over r's examples, desirable and undesirable together, of
                 w·(1 − σ(·)); the KL baseline z₀ is r's mean of the KL pairs' log-ratios,
                 gathered and averaged over processes (then clamped at 0): the global mean, the
                 same constant on every rank. So again the mean of means. (Checked: z₀ > 0,
                 not clamped away, and every rank logs the global z₀.)
  RLOO           loss_r = mean over r's rows of the clipped sequence-level surrogate; the
                 advantages are computed over the whole generation batch before it is split,
                 so they are inputs here: the mean of means.
  distillation   training passes N, the loss-mask count gathered over processes, and TRL
                 divides by N / P: loss_r = Σ_{r's tokens} D / (N / P), as dapo. Without N
                 (evaluation) TRL divides by r's own count n_r, which is by definition not the
                 global loss: checked instead is Σ_r n_r loss_r / Σ_r n_r = the global loss
                 (and that the plain mean of the ranks' losses differs from it).
The metrics these four log in `compute_loss` are all gathered over processes, so every rank
logs the global batch's values (`num_tokens` is a running total: the ranks took two steps).
That the fused path ran: on every rank the step made as many grpo_lce calls as the single
process (`grpo_lce._dispatch.recording`), and the trainer logged no fallback to TRL's head. The
GRPO and SFT steps (DDP, FSDP2, ZeRO-3) run inside `_trainer_pairs.fused_head_ran`, on every
rank and in the single-process reference (`_ddp_worker.grpo_step`, `sft_step`).

Tolerances. fp32; the two sides run identical weights on different row groupings (DPO and
KTO: per-rank padding too), so only summation order differs: losses and gradients within 3× of
the single process's own distance to the same step in fp64 (TRL's head on fp64 models;
tests/_tolerance.py), which grows with the depth and sum lengths as the rounding does on any
machine; metrics rel 1e-5 / abs 2e-6.
That DDP really all-reduced: the synced gradients are bitwise equal on both ranks, while each
rank's local gradient (under `no_sync()`) is nonzero and off the reference by more than
1e-2 × max|grad|, and the mean of the local ones equals the reference.
FSDP2 (the same loss arguments: its reduce-scatter averages over ranks as DDP's all-reduce
does): the gradients gathered whole (`full_tensor`) are bitwise equal on both ranks and match
the reference, which the rank-local gradients of the DDP scenario (same model, same rows) do
not; the LM head weight was a DTensor when the step began.
"""

from __future__ import annotations

import copy
import importlib.util
import os
import socket
import subprocess
import sys
import time

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
import _ddp_fastgen as F
import _ddp_nf4 as N
import _ddp_trainers as T  # noqa: E402
import _ddp_worker as W  # noqa: E402
from _tolerance import assert_grads_vs_fp64, assert_loss_vs_fp64
from _trainer_pairs import trl_head_in_fp64

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORLD = 2
SCENARIOS = "ddp,fsdp2" + (",zero3" if importlib.util.find_spec("deepspeed") else "")
# the four trainers under DDP, and SFT and those four under FSDP2 (tests/_ddp_worker.py)
TRAINER_SCENARIOS = ",".join((*T.NAMES, "fsdp2_trainers"))
# FSDP2 case -> its single-process reference (the same builder, batch and step)
FSDP2_TRAINER_CASES = {"sft": "sft", **{n: n for n in T.NAMES},
                       "distillation_sharded_teacher": "distillation"}
NF4_SCENARIO = "ddp_nf4"  # the six trainers on NF4 bases under DDP (tests/_ddp_nf4.py)
FASTGEN_SCENARIO = F.CASE  # GRPO sampling through the decode loop on each rank
# A rank's first generation less its own graph captures: its own eager work (prefill, <= 9
# decode steps and the loop's first-call check of a 2-layer H = 64 model on 2 rows, TRL's
# tokenizing and its length gathers: well under a second on an idle CPU or GPU) plus any
# wait on the other rank. The ranks start it together (a barrier) and do not synchronise
# inside it except TRL's gathers, so nothing waits on the other's capture; 30 s leaves room
# for a loaded shared CPU and a cold Triton cache, while a rank held by its peer's capture or
# a stuck collective goes past it (gloo's and NCCL's own timeouts are minutes).
WAIT_BOUND_S = 30.0
# SFT and the four on a DeepSpeed ZeRO-3 engine (tests/_ddp_worker.py runs them last)
ZERO3_TRAINER_CASES = ("sft", *T.NAMES)
if importlib.util.find_spec("deepspeed"):
    TRAINER_SCENARIOS += ",zero3_trainers"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _assert_loss(loss, r: dict, what: str):
    """A DDP / FSDP2 / ZeRO-3 loss (fp32) against the single process's (fp32) and its fp64
    truth: within K_REORDERED of the single process's own error (tests/_tolerance.py); the
    tiny batches' losses average <= 64 tokens' or pairs' terms."""
    assert_loss_vs_fp64(loss, r["loss"], r["fp64"][0], n_terms=64, what=what)


def _assert_grads(got: dict, r: dict, what: str):
    """Gradients, as `_assert_loss`: per parameter within K_REORDERED of the single process's
    own distance to fp64 (tests/_tolerance.py's `assert_grads_vs_fp64`)."""
    assert_grads_vs_fp64(got, r["grads"], r["fp64"][1], what=f"{what} grad")


# Every test that reads this fixture is marked `slow` (the 2-process worker runs all scenarios at
# once, so no single case is cheap); the refusals and `F.global_batch` run in the default suite.
@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(single-process reference results, [rank 0 results, rank 1 results])."""
    from trainers.tiny import build_tokenizer

    tok = build_tokenizer()
    out = tmp_path_factory.mktemp("ddp")
    ref = {}
    tr = W.grpo_trainer(tok, W.tiny_model(tok, peft=True), str(out / "ref"), 1)
    batches = {"grpo": W.grpo_batch(tok, tr), "sft": W.sft_batch(tok)}
    batches["sft_num_items"] = (batches["sft"]["labels"][:, 1:] != -100).sum()
    trainers = {name: T.build(name, tok, str(out / "ref"), 1) for name in T.NAMES}
    for name, t in trainers.items():
        batches[name] = T.batches(name, tok, t, WORLD)
    nf4_trainers, nf4_batches = N.prepare(tok, str(out), WORLD, batches["sft"])
    batches.update(nf4_batches)
    torch.save(batches, out / "inputs.pt")

    # start the ranks first: they run while the reference is computed here
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    cmd = [sys.executable, os.path.join(REPO, "tests", "_ddp_worker.py"), "--out", str(out),
           "--port", str(_free_port()), "--nprocs", str(WORLD),
           "--scenarios",
           f"{SCENARIOS},{FASTGEN_SCENARIO},{TRAINER_SCENARIOS},{NF4_SCENARIO}"]
    t0 = time.time()
    proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)

    # each reference step also in fp64 (`trl_head_in_fp64`), the truth that the tolerances
    # measure the single process's and the ranks' fp32 results against
    for loss_type in W.LOSS_TYPES:
        tr.loss_type = loss_type
        tr._metrics["train"].clear()
        loss, grads = W.grpo_step(tr, tr.model, batches["grpo"])
        ref[f"grpo_{loss_type}"] = {"loss": loss, "grads": grads,
                                    "entropy": tr._metrics["train"]["entropy"][-1]}
        with trl_head_in_fp64(tr):
            ref[f"grpo_{loss_type}"]["fp64"] = W.grpo_step(tr, tr.model, batches["grpo"])
    sft = W.sft_trainer(tok, W.tiny_model(tok, peft=True), str(out / "ref"), 1)
    sft_args = sft, sft.model, batches["sft"], batches["sft_num_items"]
    loss, grads = W.sft_step(*sft_args)
    with trl_head_in_fp64(sft):
        ref["sft"] = {"loss": loss, "grads": grads, "fp64": W.sft_step(*sft_args)}
    for peft in (False, True):
        tr_f = W.grpo_trainer(tok, W.tiny_model(tok, peft=peft), str(out / "ref"), 1,
                              loss_type="dapo")
        loss, grads = W.grpo_step(tr_f, tr_f.model, batches["grpo"])
        with trl_head_in_fp64(tr_f):
            loss64, grads64 = W.grpo_step(tr_f, tr_f.model, batches["grpo"])
        ref[f"fsdp2_{'lora' if peft else 'full'}"] = {"loss": loss, "grads": grads,
                                                     "fp64": (loss64, grads64)}
    for name, t in trainers.items():
        ref[name] = T.reference_with_fp64(name, t, batches[name])
    # NF4: the fp64 truth is each model's dequantized twin (tests/_ddp_nf4.py)
    ref.update(N.reference_results(nf4_trainers, batches, str(out)))

    try:
        log, _ = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        proc.kill()
        log, _ = proc.communicate()
        pytest.fail(f"worker timed out:\n{log[-4000:]}")
    assert proc.returncode == 0, f"worker failed (rc {proc.returncode}):\n{log[-6000:]}"
    print(f"{WORLD}-process worker: {time.time() - t0:.1f} s")
    ranks = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]
    return ref, ranks


@pytest.mark.slow
@pytest.mark.parametrize("case", ["grpo_dapo", "grpo_grpo", "sft"])
def test_ddp_matches_single_process(runs, case):
    _assert_ddp_step(*runs, case)


def _assert_ddp_step(ref, ranks, case):
    r = ref[case]
    # the DDP loss is the mean of the ranks' losses (what the logged loss averages to)
    loss = torch.stack([rk[case]["loss"] for rk in ranks]).mean()
    _assert_loss(loss, r, f"{case} loss")
    for rank, rk in enumerate(ranks):
        _assert_grads(rk[case]["synced"], r, f"{case} rank {rank} (DDP)")
        assert all("lora_" in n for n in rk[case]["synced"])
    # the all-reduce happened: identical on every rank, the local grads alone are wrong,
    # and their average is the reference
    for n, g0 in ranks[0][case]["synced"].items():
        assert torch.equal(g0, ranks[1][case]["synced"][n]), f"{case} {n}: ranks differ"
    worst = max(
        ((rk[case]["local"][n] - g).abs().max() / g.abs().max()).item()
        for rk in ranks for n, g in r["grads"].items()
    )
    assert worst > 1e-2, f"{case}: local grads equal the reference ({worst:.2e}): no sync test"
    for rank, rk in enumerate(ranks):  # every rank contributes (not, e.g., all rows clipped)
        assert max(g.abs().max() for g in rk[case]["local"].values()) > 0, (case, rank)
    mean_local = {n: sum(rk[case]["local"][n] for rk in ranks) / WORLD for n in r["grads"]}
    _assert_grads(mean_local, r, f"{case} mean of local")
    if "entropy" in r:  # TRL's metric gathers over processes: the global masked mean
        for rk in ranks:
            assert rk[case]["entropy"] == pytest.approx(r["entropy"], rel=1e-5, abs=2e-6)


@pytest.fixture(scope="module")
def fastgen_runs(runs, tmp_path_factory):
    """(the grpo_fastgen single-process reference, the ranks' results): the reference scores
    the global batch the ranks sampled, so it is computed after them (tests/_ddp_fastgen.py)."""
    from trainers.tiny import build_tokenizer

    _, ranks = runs
    out = tmp_path_factory.mktemp("fastgen_ref")
    return F.reference_results(build_tokenizer(), ranks, str(out)), ranks


@pytest.mark.slow
@pytest.mark.parametrize("loss_type", W.LOSS_TYPES)
def test_grpo_fastgen_matches_single_process(fastgen_runs, loss_type):
    """GRPO under DDP, each rank sampling its generation batch through its own decode loop in
    TRL's `_generate_and_score_completions`: the DDP loss and gradients on the samples are the
    single process's on the global batch the ranks' samples form, with `_assert_ddp_step`'s
    checks and tolerances (the module docstring's loss arguments: the samples are inputs)."""
    _assert_ddp_step(*fastgen_runs, f"{F.CASE}_{loss_type}")


@pytest.mark.slow
def test_grpo_fastgen_each_rank_sampled_with_its_loop(fastgen_runs):
    check_fastgen_sampling(fastgen_runs[1], captured=False)  # eager on CPU: no graphs


def check_fastgen_sampling(ranks, *, captured: bool):
    """What each rank of grpo_fastgen sampled and how: TRL dealt it G copies of one prompt,
    another prompt than the other rank's; its own decode loop served the call (no fallback)
    and the completions trained on are the ones the loop returned; rewards and the token count
    went through TRL's cross-process gathers (the global `num_items_in_batch` on every rank,
    each group's advantages nonzero); with `captured` the loop captured its graphs; and the
    generation took at most WAIT_BOUND_S beyond the rank's own capture time."""
    recs = [rk[F.CASE] for rk in ranks]
    for rank, rec in enumerate(recs):
        assert len(rec["prompts"]) == F.G and len(set(rec["prompts"])) == 1, (rank,
                                                                             rec["prompts"])
    assert len({rec["prompts"][0] for rec in recs}) == len(recs), [r["prompts"] for r in recs]
    total = sum(int(rec["inputs"]["completion_mask"].sum()) for rec in recs)
    for rank, rec in enumerate(recs):
        assert rec["served"] == {"loop": 1, "compiled": 0, "trl": 0}, (rank, rec["served"])
        assert rec["loop_off"] is None and rec["loop_disabled"] is None, (rank, rec)
        m = rec["metrics"]
        assert m["fast_generation/loop_calls"] >= 1 and m["fast_generation/trl_calls"] == 0, m
        ((sampler, ids),) = rec["seen"]
        inp = rec["inputs"]
        trained = [row[mask.bool()].tolist()
                   for row, mask in zip(inp["completion_ids"], inp["completion_mask"])]
        assert sampler == "loop" and trained == ids, (rank, trained, ids)
        assert int(inp["num_items_in_batch"]) == total, (rank, inp["num_items_in_batch"], total)
        assert (inp["advantages"] != 0).all(), (rank, inp["advantages"])
        if captured:
            assert rec["captures"] >= 1 and 0 < rec["capture_s"] <= rec["generation_s"], rec
        else:
            assert rec["captures"] == 0 and rec["capture_s"] == 0, rec
        wait = rec["generation_s"] - rec["capture_s"]
        print(f"rank {rank}: first generation {rec['generation_s']:.3f} s, "
              f"{rec['captures']} captures {rec['capture_s']:.3f} s")
        assert wait < WAIT_BOUND_S, (rank, rec["generation_s"], rec["capture_s"])


def test_fastgen_global_batch_pads_completions():
    """`F.global_batch` on ragged completions: right-padded to the longest (pad id, mask 0,
    per-token values 0), rows in rank order, the global scalar kept; mismatches refused."""
    def part(n_rows, width, fill):
        return {"prompt_ids": torch.full((n_rows, 3), fill), "prompt_mask": torch.ones(n_rows, 3),
                "completion_ids": torch.full((n_rows, width), fill),
                "completion_mask": torch.ones(n_rows, width),
                "old_per_token_logps": torch.full((n_rows, width), -1.0),
                "importance_sampling_ratio": torch.ones(n_rows, 1),
                "advantages": torch.arange(n_rows, dtype=torch.float) + fill,
                "num_items_in_batch": torch.tensor(5)}
    out = F.global_batch([part(2, 3, 7), part(2, 1, 8)], pad_token_id=0)
    assert out["completion_ids"].tolist() == [[7] * 3] * 2 + [[8, 0, 0]] * 2
    assert out["completion_mask"].tolist() == [[1] * 3] * 2 + [[1, 0, 0]] * 2
    logps = out["old_per_token_logps"]
    assert logps.size(1) == 3 and logps[2:, 1:].eq(0).all() and logps[:, 0].eq(-1).all()
    assert out["importance_sampling_ratio"].shape == (4, 1)
    assert out["advantages"].tolist() == [7, 8, 8, 9] and int(out["num_items_in_batch"]) == 5
    with pytest.raises(ValueError, match="global scalar 'num_items_in_batch'"):
        F.global_batch([part(2, 3, 7), {**part(2, 3, 8), "num_items_in_batch": torch.tensor(6)}],
                       pad_token_id=0)
    wide = part(2, 3, 8)
    wide["prompt_ids"] = wide["prompt_mask"] = torch.ones(2, 4)
    with pytest.raises(ValueError, match="prompt widths differ"):
        F.global_batch([part(2, 3, 7), wide], pad_token_id=0)


@pytest.mark.slow
@pytest.mark.parametrize("case", T.NAMES)
def test_trainer_ddp_matches_single_process(runs, case):
    """DPO, KTO, RLOO and distillation (LoRA) under DDP: the checks of
    `test_ddp_matches_single_process`, and that each rank ran grpo_lce as often as the single
    process did, with no fallback to TRL's head (module docstring: why each loss agrees)."""
    ref, ranks = runs
    _assert_ddp_step(ref, ranks, case)
    r = ref[case]
    for rank, rk in enumerate(ranks):
        assert rk[case]["fallbacks"] == [] == r["fallbacks"], (rank, rk[case]["fallbacks"])
        assert rk[case]["calls"] == r["calls"] > 0, (rank, rk[case]["calls"])
        # TRL gathers every metric of these steps over processes: the global batch's values
        assert rk[case]["metrics"].keys() == r["metrics"].keys()
        for k, v in r["metrics"].items():
            if k == "num_tokens":  # a running total, and the ranks took two steps (local, synced)
                assert rk[case]["metrics"][k] == 2 * v, (rank, k)
                continue
            assert rk[case]["metrics"][k] == pytest.approx(v, rel=1e-5, abs=2e-6), (rank, k)
    if case == "kto":  # the KL baseline is positive (not clamped away) and gathered
        assert r["metrics"]["kl"] > 0
    if case == "rloo":  # the clipped branch is exercised
        assert 0 < r["metrics"]["clip_ratio/region_mean"] < 1
    if case == "distillation":
        # without num_items_in_batch each rank divides by its own n_r loss tokens: not the
        # global loss by definition, but its n_r-weighted mean is
        parts = [rk[case]["token_mean_loss"] for rk in ranks]
        n = [p["n_valid"] for p in parts]
        assert n[0] != n[1] and sum(n) == ref[case]["token_mean_loss"]["n_valid"], n
        weighted = sum(p["loss"] * p["n_valid"] for p in parts) / sum(n)
        r_tm = ref[case]["token_mean_loss"]
        assert_loss_vs_fp64(weighted, r_tm["loss"], r_tm["fp64"], n_terms=64,
                            what="distillation token-mean loss")
        plain = torch.stack([p["loss"] for p in parts]).mean()
        assert (plain - weighted).abs() > 1e-3 * weighted.abs(), "the two means coincide"


@pytest.mark.slow
@pytest.mark.parametrize("case", N.CASES)
def test_nf4_ddp_matches_single_process(runs, case):
    """GRPO (dapo), SFT, DPO, KTO, RLOO and distillation with a bitsandbytes NF4 base + LoRA
    (frozen fp32 head) under DDP: the checks of `test_ddp_matches_single_process` against the
    single process on the global batch, whose fp64 truth is the dequantized twin's step
    (tests/_ddp_nf4.py: why that is the 4-bit model's exact math, and that the single process
    lies within tolerance of it); each rank ran grpo_lce as often as the single process, with
    no fallback, and logged the global batch's metrics (within K_REORDERED of the single
    process's distance to the twin's fp64 metrics, as the losses). The loss arguments are the
    fp32 scenarios' (module docstring): quantization changes the weights, not the reductions.
    TRL casts the adapters of a quantized model to bf16, so the gradients compared are bf16
    and the tolerance's scale (the single process's distance to fp64) is bf16's."""
    ref, ranks = runs
    key = f"nf4_{case}"
    _assert_ddp_step(ref, ranks, key)
    r = ref[key]
    assert all(g.dtype == torch.bfloat16 for g in r["grads"].values())  # TRL's QLoRA cast
    for rank, rk in enumerate(ranks):
        assert rk[key]["fallbacks"] == [] == r["fallbacks"], (rank, rk[key]["fallbacks"])
        assert rk[key]["calls"] == r["calls"] > 0, (rank, rk[key]["calls"])
        assert rk[key]["metrics"].keys() == r["metrics"].keys()
        for k in N.GLOBAL_METRICS.get(case, r["metrics"].keys()):
            v = r["metrics"][k]
            if k == "num_tokens":  # a running total, and the ranks took two steps
                assert rk[key]["metrics"][k] == 2 * v, (rank, k)
                continue
            # bf16 adapters: rounding-level differences of bf16's size, so against the fp64
            # twin's value as the losses are (a metric is a mean of <= 64 terms' values)
            assert_loss_vs_fp64(rk[key]["metrics"][k], v, r["fp64_metrics"][k], n_terms=64,
                                what=f"{key} rank {rank} metric {k}")


@pytest.mark.slow
@pytest.mark.parametrize("case", ["fsdp2_full", "fsdp2_lora"])
def test_fsdp2_matches_single_process(runs, case):
    # full: the tied head/embedding is trainable and sharded (DTensor); its gradient gets the
    # head's part through trainers.sharded's gather (reduce-scattered, averaged) and the
    # embedding-lookup part through FSDP2's own reduce-scatter: both must add up.
    ref, ranks = runs
    r = ref[case]
    loss = torch.stack([rk[case]["loss"] for rk in ranks]).mean()
    _assert_loss(loss, r, f"{case} loss")
    for rank, rk in enumerate(ranks):
        _assert_grads(rk[case]["synced"], r, f"{case} rank {rank} (FSDP2)")
    if case == "fsdp2_full":
        assert "model.embed_tokens.weight" in r["grads"]


@pytest.mark.slow
@pytest.mark.parametrize("case", list(FSDP2_TRAINER_CASES))
def test_trainer_fsdp2_matches_single_process(runs, case):
    """SFT, DPO, KTO, RLOO and distillation (LoRA, frozen head) with the policy under FSDP2
    (`fully_shard` as accelerate lays it out; DPO's and KTO's references are adapters of the
    same sharded model; distillation's teacher whole, as TRL + accelerate leave it, or sharded
    too): the loss and the whole gathered gradients are the single process's, and grpo_lce ran
    on every rank as often as in the single process, with no fallback. Why each loss agrees:
    the module docstring (FSDP2 averages the gradients over ranks as DDP does)."""
    ref, ranks = runs
    # the policy's head (and a sharded teacher's) was a DTensor, gathered by trainers.sharded
    want = "DTensor+teacher DTensor" if case.endswith("sharded_teacher") else "DTensor"
    _assert_sharded_trainer_step(ranks, f"fsdp2_{case}", ref[FSDP2_TRAINER_CASES[case]],
                                 FSDP2_TRAINER_CASES[case], want, "FSDP2's")


def _assert_sharded_trainer_step(ranks, key: str, r: dict, local: str, head: str, how: str):
    """A trainer step with the policy sharded (FSDP2 or ZeRO-3), results under `key` on the
    ranks, against the single process's `r`: the mean loss and each rank's whole gathered
    gradients (equal on both ranks, LoRA only), the head's layout `head`, grpo_lce's calls with
    no fallback, the gathered metrics; and that a rank's own rows alone (the DDP scenario
    `local`'s rank-local gradients, same model and rows) give other gradients, so matching `r`
    needed `how` reduction."""
    loss = torch.stack([rk[key]["loss"] for rk in ranks]).mean()
    _assert_loss(loss, r, f"{key} loss")
    for rank, rk in enumerate(ranks):
        assert rk[key]["head"] == head, (rank, rk[key]["head"])
        _assert_grads(rk[key]["synced"], r, f"{key} rank {rank}")
        assert rk[key]["synced"].keys() == r["grads"].keys()
        assert all("lora_" in n for n in rk[key]["synced"])
        assert rk[key]["fallbacks"] == [] == r.get("fallbacks", []), (rank, rk[key]["fallbacks"])
        # SFT: one head call per step (its reference asserted >= 1 call, no count kept)
        assert rk[key]["calls"] == r.get("calls", 1) > 0, (rank, rk[key]["calls"])
    for n, g0 in ranks[0][key]["synced"].items():  # the same reduced shards, gathered
        assert torch.equal(g0, ranks[1][key]["synced"][n]), f"{key} {n}: ranks differ"
    worst = max(((rk[local]["local"][n] - g).abs().max() / g.abs().max()).item()
                for rk in ranks for n, g in r["grads"].items())
    assert worst > 1e-2, (f"{key}: a rank's local grads equal the reference ({worst:.2e}): "
                          f"no {how} reduction tested")
    if "metrics" in r:  # TRL gathers every metric over processes: the global batch's values
        for rank, rk in enumerate(ranks):
            assert rk[key]["metrics"].keys() == r["metrics"].keys()
            for k, v in r["metrics"].items():  # one step each: num_tokens' totals agree too
                assert rk[key]["metrics"][k] == pytest.approx(v, rel=1e-5, abs=2e-6), (rank, k)


@pytest.mark.slow
def test_zero3_matches_single_process(runs):
    # LoRA under ZeRO-3: the frozen head is gathered and copied by trainers.sharded, the LoRA
    # gradients are reduce-scattered (averaged) by ZeRO-3 itself. Same model, loss (dapo) and
    # batch as the fsdp2_lora case, so that is the reference.
    pytest.importorskip("deepspeed")
    ref, ranks = runs
    r = ref["fsdp2_lora"]
    loss = torch.stack([rk["zero3_lora"]["loss"] for rk in ranks]).mean()
    _assert_loss(loss, r, "zero3 loss")
    for rank, rk in enumerate(ranks):
        _assert_grads(rk["zero3_lora"]["synced"], r, f"zero3 rank {rank}")


@pytest.mark.slow
@pytest.mark.parametrize("case", ZERO3_TRAINER_CASES)
def test_trainer_zero3_matches_single_process(runs, case):
    """SFT, DPO, KTO, RLOO and distillation (LoRA, frozen head) with the policy on a DeepSpeed
    ZeRO-3 engine: every weight partitioned, the head released to numel 0 between forwards and
    gathered by trainers.sharded; DPO's and KTO's references are adapters of the same engine's
    model; distillation's teacher on its own ZeRO-3 engine from TRL's `prepare_deepspeed`, as
    TRL 1.16's DistillationTrainer prepares it under DeepSpeed. The checks of the FSDP2 case:
    loss and whole gradients are the single process's (ZeRO-3 reduce-scatters the gradients
    averaged over ranks, as DDP does: the module docstring's loss arguments hold), grpo_lce ran
    as often as in one process with no fallback, and the gathered metrics are the global
    batch's."""
    pytest.importorskip("deepspeed")
    ref, ranks = runs
    # the teacher's weights keep requires_grad (neither TRL nor the builder freezes them); its
    # head is read under no_grad, where trainers.sharded gathers a trainable ZeRO-3 head too
    want = ("partitioned frozen+teacher partitioned trainable" if case == "distillation"
            else "partitioned frozen")
    _assert_sharded_trainer_step(ranks, f"zero3_{case}", ref[case], case, want, "ZeRO-3's")


@pytest.mark.slow
def test_zero3_trainable_head_refused_at_construction(runs):
    """GRPOTrainer and SFTTrainer built on the ranks with a real ZeRO-3 `deepspeed=` config
    (accelerate's DeepSpeed plugin on): a LoRA model (frozen head) is accepted, the full model
    (trainable head, which trainers.sharded cannot serve) is refused by `check_parallelism`."""
    pytest.importorskip("deepspeed")
    _, ranks = runs
    for rank, rk in enumerate(ranks):
        got = rk["zero3_refusals"]
        for name, cls in (("grpo", "GRPOTrainer"), ("sft", "SFTTrainer")):
            assert got[f"{name}_lora"] == "built, stage 3", (rank, name, got[f"{name}_lora"])
            assert got[f"{name}_full"].startswith(
                f"ValueError: trainers.{cls} supports DeepSpeed ZeRO-3 only with a frozen LM "
                "head"), (rank, name, got[f"{name}_full"])


# ---------------------------------------------------------------- check_parallelism refusals

class _Obj:
    def __init__(self, **kw):
        self.__dict__.update(kw)


def _fake_trainer(model, *, fsdp_version=None, offload=None, zero_stage=None):
    state = _Obj(
        fsdp_plugin=None if fsdp_version is None else _Obj(fsdp_version=fsdp_version,
                                                           cpu_offload=offload),
        deepspeed_plugin=None if zero_stage is None else _Obj(zero_stage=zero_stage),
    )
    return _Obj(
        model=model, accelerator=_Obj(state=state),
        is_fsdp_enabled=fsdp_version is not None, is_deepspeed_enabled=zero_stage is not None,
    )


def test_check_parallelism_refusals():
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

    from trainers.head import check_parallelism
    from trainers.tiny import build_tokenizer

    tok = build_tokenizer()
    lora, full = W.tiny_model(tok, peft=True), W.tiny_model(tok, peft=False)
    check_parallelism(_fake_trainer(full, fsdp_version=2, offload=OffloadPolicy()))
    check_parallelism(_fake_trainer(lora, zero_stage=3))  # frozen head: supported
    check_parallelism(_fake_trainer(full, zero_stage=2))
    with pytest.raises(ValueError, match="FSDP1.*fsdp_version"):
        check_parallelism(_fake_trainer(full, fsdp_version=1))
    with pytest.raises(ValueError, match="cpu_offload"):
        check_parallelism(_fake_trainer(full, fsdp_version=2, offload=CPUOffloadPolicy()))
    with pytest.raises(ValueError, match="ZeRO-3 only with a frozen LM head"):
        check_parallelism(_fake_trainer(copy.deepcopy(full), zero_stage=3))
    # every trainer runs these checks at construction (`FusedHeadMixin.__init__`), so FSDP2
    # with CPU offload stays refused for SFT, DPO, KTO, RLOO and distillation as for GRPO
    import trainers
    from trainers.base import FusedHeadMixin

    for name in ("GRPOTrainer", "SFTTrainer", "DPOTrainer", "KTOTrainer", "RLOOTrainer",
                 "DistillationTrainer"):
        assert issubclass(getattr(trainers, name), FusedHeadMixin), name


def _shape(tree):
    """The nested keys of a results dict (tensors and numbers as leaves)."""
    if isinstance(tree, dict):
        return {k: _shape(v) for k, v in tree.items()}
    if isinstance(tree, (tuple, list)):
        return [_shape(v) for v in tree]
    return None


@pytest.mark.slow
def test_gpu_reference_writer_matches_the_fixture(runs, tmp_path):
    """tests/test_multigpu.py's single-process reference comes from `_ddp_worker.py
    --reference`, not from this module's fixture: run it here on CPU; it must write every
    result the checks read (the fp64 truths included), with the fixture's losses."""
    ref, _ = runs
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, os.path.join(REPO, "tests", "_ddp_worker.py"), "--reference",
           "--device", "cpu", "--nprocs", str(WORLD), "--out", str(tmp_path)]
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    written = torch.load(tmp_path / "ref.pt", weights_only=False)
    for case, r in ref.items():
        assert _shape(written[case]) == _shape(r), case
        _assert_loss(written[case]["loss"], r, f"{case} loss by the reference writer")


@pytest.mark.slow
def test_fastgen_reference_writer_matches_the_fixture(fastgen_runs, tmp_path):
    """tests/test_multigpu.py's grpo_fastgen reference comes from `_ddp_worker.py
    --fastgen-reference` after the ranks: run it here on CPU on this run's rank files; it must
    write the fixture's results, with the fixture's losses and gradients."""
    ref, ranks = fastgen_runs
    for r, rk in enumerate(ranks):
        torch.save(rk, tmp_path / f"rank{r}.pt")
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, os.path.join(REPO, "tests", "_ddp_worker.py"), "--fastgen-reference",
           "--device", "cpu", "--nprocs", str(WORLD), "--out", str(tmp_path)]
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=240,
                          check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    written = torch.load(tmp_path / "ref_fastgen.pt", weights_only=False)
    assert written.keys() == ref.keys() == {f"{F.CASE}_{t}" for t in W.LOSS_TYPES}
    for case, r in ref.items():
        assert _shape(written[case]) == _shape(r), case
        _assert_loss(written[case]["loss"], r, f"{case} loss by the reference writer")
        _assert_grads(written[case]["grads"], r, f"{case} by the reference writer")
