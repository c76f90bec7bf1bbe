"""4-bit (bitsandbytes NF4) bases with LoRA under DDP, for tests/test_ddp.py (CPU, gloo) and
tests/test_multigpu.py (GPUs, nccl): the models, the trainers, one step, and the fp64 truth.

Cases (results "nf4_<case>"): GRPO (loss_type dapo), SFT, DPO, KTO, RLOO and distillation,
each the trainer, data and batch of the fp32 DDP scenarios (tests/_ddp_worker.py for GRPO and
SFT, tests/_ddp_trainers.py for the other four), with the policy's base quantized:

    grpo_dapo, sft   trainers.tiny's Llama (tied), NF4, `with_lora`
    dpo, rloo        the same Llama untied, NF4 (DPO: `peft_config`, the disabled adapter as
                     reference; RLOO: `with_lora`)
    kto              the untied tiny Qwen2, NF4, `with_lora` (TRL adds the "ref" adapter)
    distillation     the soft-head Llama student (tied), NF4, `with_lora`; the fp32 Qwen2
                     teacher of tests/_ddp_trainers.py, not quantized

NF4 with double quantization (QLoRA's `trainers.config.nf4_config`) and compute dtype fp32:
every q/k/v/o and MLP projection is a bnb `Linear4bit`; bitsandbytes leaves the LM head (and the
tied embedding) unquantized, so the head stays a frozen fp32 weight that grpo_lce reads.

Bit-identical weights on both sides: `quantize_bases` quantizes each base once (fp32 model ->
`from_pretrained(quantization_config=...)`) and saves the packed result; the single process and
every rank load that checkpoint (`load_base`), so all start from the same 4-bit codes and
absmax. LoRA weights come from the seeded `with_lora`, as in the fp32 scenarios.

The fp64 truth. `in_fp64` cannot convert a bnb 4-bit layer (its packed uint8 weight and quant
state stay as they are, and the layer casts its input back to the compute dtype). But with
compute dtype fp32, a `Linear4bit` computes y = x Wᵀ (+ b) with W = `dequantize_4bit(codes,
quant_state)`, the fp32 weight NF4 code × absmax (the absmax itself dequantized from its 8-bit
code under double quantization): bitsandbytes dequantizes W and hands it to `F.linear` in the
forward (`gemm_4bit`'s dequantize-then-linear path: every CPU call; on CUDA for fp32 inputs of
more than 7 rows, as all of these batches are) and multiplies the output gradient by the same W
in the backward. So the 4-bit fp32 step is the fp32 step of a plain model whose every
`Linear4bit` is an `nn.Linear` holding that dequantized W, with the same LoRA weights: the twin
(`to_twin`). W is an fp32 tensor, exact in fp64, so the twin's fp64 step (`trl_head_in_fp64`)
is the exact-arithmetic value of the same computation: the truth the fp32 4-bit results (one
process and the ranks) are measured against, as the fp32 scenarios' are against their models
in fp64. `reference_results` checks this on the single process: the 4-bit step lies within
tolerance of the twin's fp64 step (three-way, with the twin's own fp32 step), and the
dequantized W differ from the fp32 weights they were quantized from (quantization happened).

The adapters. TRL 1.16 casts the trainable weights of a quantized model's adapter to bf16
(QLoRA's recipe), so on both sides the LoRA terms run in bf16 (PEFT casts their input to bf16
and their output back to fp32) and the LoRA gradients are bf16 tensors. The twin keeps those
bf16 adapters for its fp32 step; for its fp64 step they are cast up, exactly, with the rest.
The rounding of the activations to bf16 is then part of what the fp32 steps carry and the fp64
truth does not, so the tolerances, which scale with the single process's own distance to the
truth, are bf16's size (tests/_tolerance.py's three-way argument holds for any rounding).

On CPU, bitsandbytes repacks a 4-bit weight for its AVX512-BF16 kernel when a layer runs in eval
mode on an input without grad, rounding absmax to bf16: another W than the twin's.
`load_base` turns that off (`support_avx512bf16_for_cpu = False`) and `step` asserts every
layer is still in the standard packing afterwards.
"""

from __future__ import annotations

import os

import _ddp_trainers as T
import torch

CASES = ("grpo_dapo", "sft", "dpo", "kto", "rloo", "distillation")
# The metrics each case logs for the global batch on every rank (TRL gathers them); the rest,
# all of them, by default. GRPO's clip ratios are per-rank token means, gathered and then
# averaged or min/maxed over ranks: not the global batch's values by definition.
GLOBAL_METRICS = {"grpo_dapo": ("entropy",)}
BASES = {"grpo_dapo": "llama_tied", "sft": "llama_tied", "dpo": "llama_untied",
         "rloo": "llama_untied", "kto": "qwen2_untied", "distillation": "llama_soft_tied"}


def nf4_config():
    """QLoRA's NF4 (`trainers.config.nf4_config`: double quantization) with fp32 compute."""
    from trainers.config import nf4_config as qlora

    config = qlora()
    config.bnb_4bit_compute_dtype = torch.float32
    return config


def _fp32_base(tok, base: str):
    from _tiny_models import build_tiny_qwen2, soft_head_model

    from trainers.tiny import build_tiny_llama

    if base == "llama_tied":
        return build_tiny_llama(tok, hidden_size=64, num_layers=2)
    if base == "llama_untied":
        return build_tiny_llama(tok, hidden_size=64, num_layers=2, tie_word_embeddings=False)
    if base == "qwen2_untied":
        return build_tiny_qwen2(tok, tie_word_embeddings=False)
    if base == "llama_soft_tied":
        return soft_head_model(tok, "llama", tied=True, peft=False)
    raise ValueError(f"base={base!r}: expected one of {sorted(set(BASES.values()))}")


def _load_device(device: str) -> str:
    return f"cuda:{torch.cuda.current_device()}" if device == "cuda" else "cpu"


def quantize_bases(tok, out_dir: str, device: str) -> None:
    """Each base of BASES in fp32, saved, loaded with `nf4_config()` on `device` (quantized
    there) and saved packed to OUT/nf4/<base>: the one quantization both sides load."""
    from transformers import AutoModelForCausalLM

    for base in sorted(set(BASES.values())):
        src, dst = (os.path.join(out_dir, "nf4", f"{base}{s}") for s in ("-fp32", ""))
        _fp32_base(tok, base).save_pretrained(src)
        q = AutoModelForCausalLM.from_pretrained(
            src, quantization_config=nf4_config(), dtype=torch.float32,
            device_map={"": _load_device(device)})
        q.save_pretrained(dst)


def linear4bit_layers(model) -> list:
    import bitsandbytes as bnb

    return [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]


def load_base(out_dir: str, base: str, device: str):
    """The quantized base OUT/nf4/<base> on `device` (rank r: cuda:r), its layers kept in
    bitsandbytes' standard packing (module docstring)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        os.path.join(out_dir, "nf4", base), dtype=torch.float32,
        device_map={"": _load_device(device)})
    layers = linear4bit_layers(model)
    assert len(layers) == 7 * model.config.num_hidden_layers, len(layers)
    for m in layers:
        m.support_avx512bf16_for_cpu = False
    return model


def build(case: str, tok, out_dir: str, world: int, *, device: str = "cpu"):
    """The trainer of `case` on its NF4 base (module docstring), configured as the fp32
    scenario's, in train mode."""
    import _ddp_worker as W
    from _tiny_models import with_lora

    if case not in CASES:
        raise ValueError(f"case={case!r}: expected one of {CASES}")
    base = load_base(out_dir, BASES[case], device)
    if case == "grpo_dapo":
        return W.grpo_trainer(tok, with_lora(base), out_dir, world, device=device,
                              loss_type="dapo")
    if case == "sft":
        return W.sft_trainer(tok, with_lora(base), out_dir, world, device=device)
    # DPO adds its adapter from its LoraConfig; the others get theirs here
    return T.build(case, tok, out_dir, world, device=device,
                   model=base if case == "dpo" else with_lora(base))


def batch(case: str, tok, tr, world: int, sft_batch: dict) -> dict:
    """{"global": the global batch, "ranks": [rank r's rows]}: the fp32 scenario's batch, its
    old log-probs (GRPO, RLOO) from this NF4 reference trainer `tr`; SFT's the given one with its
    global token count (TRL gathers it over processes)."""
    import _ddp_worker as W

    if case == "grpo_dapo":
        full = W.grpo_batch(tok, tr)
    elif case == "sft":
        full = {**sft_batch, "num_items_in_batch": (sft_batch["labels"][:, 1:] != -100).sum()}
    else:
        return T.batches(case, tok, tr, world)
    return {"global": full, "ranks": [W.rank_slice(full, r, world) for r in range(world)]}


def step(tr, model, inputs: dict) -> dict:
    """`_ddp_trainers.step` for every case: `num_items_in_batch` (SFT's) passed as the keyword
    it is; afterwards every 4-bit layer still holds the standard packing the twin reads."""
    from trainers import SFTTrainer

    inputs = dict(inputs)
    kw = {"num_items_in_batch": inputs.pop("num_items_in_batch")} if isinstance(
        tr, SFTTrainer) else {}
    res = _step(tr, model, inputs, **kw)
    for m in linear4bit_layers(model):
        assert not getattr(m.weight.quant_state, "packing_format_for_cpu", False), m
    return res


def _step(tr, model, inputs, **kw) -> dict:
    from grpo_lce._dispatch import recording

    tr._metrics["train"].clear()
    model.zero_grad(set_to_none=True)
    with recording() as rec:
        loss = tr.compute_loss(model, inputs, **kw)
        loss.backward()
    metrics = {k: v[-1] for k, v in tr._metrics["train"].items()}
    return {"loss": loss.detach().cpu(), "grads": T._grads(model), "metrics": metrics,
            "calls": len(rec.paths), "fallbacks": sorted(tr._lce_fallbacks_logged)}


def to_twin(model) -> int:
    """Replace, in place, every bnb `Linear4bit` of `model` by an `nn.Linear` (frozen) holding
    its dequantized fp32 weight W and its bias: the twin of the module docstring. Returns how
    many were replaced."""
    import bitsandbytes as bnb
    from bitsandbytes.functional import dequantize_4bit

    todo = [(parent, name, child) for parent in model.modules()
            for name, child in parent.named_children() if isinstance(child, bnb.nn.Linear4bit)]
    for parent, name, q in todo:
        w = dequantize_4bit(q.weight.data, q.weight.quant_state)
        assert w.dtype == torch.float32 and w.shape == (q.out_features, q.in_features), w.shape
        assert_layer_is_linear(q, w)
        lin = torch.nn.Linear(q.in_features, q.out_features, bias=q.bias is not None,
                              device=w.device, dtype=torch.float32)
        with torch.no_grad():
            lin.weight.copy_(w)
            if q.bias is not None:
                lin.bias.copy_(q.bias)
        lin.requires_grad_(False)
        setattr(parent, name, lin)
    return len(todo)


def assert_layer_is_linear(q, w) -> None:
    """The 4-bit layer `q` computes x Wᵀ + b forward and dy W backward with this W, to fp32
    GEMM rounding: on a random input of 16 rows (the batches' regime: more than 7, bitsandbytes'
    dequantize-then-`F.linear` path), each output and input-gradient element within
    `gemm_bound` of the fp64 product with W. Far tighter than the step-level check, whose bf16
    adapters hide a weight error below bf16's resolution."""
    from _tolerance import EPS32, assert_within, gemm_bound

    g = torch.Generator(device="cpu").manual_seed(11)
    x = torch.randn(16, q.in_features, generator=g).to(w.device).requires_grad_(True)
    dy = torch.randn(16, q.out_features, generator=g).to(w.device)
    bias = None if q.bias is None else q.bias.detach().double()
    y = q(x)
    (dx,) = torch.autograd.grad(y, x, dy)
    w64 = w.double()
    y64 = torch.nn.functional.linear(x.detach().double(), w64, bias)
    # the bias (Qwen2's q/k/v) adds one more rounding of the result
    bound = gemm_bound(x, w.T) + (0.0 if bias is None else EPS32 * bias.abs())
    assert_within(y.detach(), y64, bound, what="4-bit layer forward vs its twin")
    assert_within(dx, dy.double() @ w64, gemm_bound(dy, w), what="4-bit layer backward vs twin")


def _fp32_weights(out_dir: str, base: str) -> dict:
    from safetensors.torch import load_file

    return load_file(os.path.join(out_dir, "nf4", f"{base}-fp32", "model.safetensors"))


def reference_results(trainers_: dict, batches: dict, out_dir: str) -> dict:
    """Single process, per case: the 4-bit fp32 step on the global batch; then the trainer's
    model turned into its twin (`to_twin`, in place) and the twin's fp32 and fp64 steps. The
    4-bit step must lie within tolerance of the fp64 truth (three-way with the twin's fp32
    step), else the twin is not the 4-bit model's math."""
    from _tolerance import assert_grads_vs_fp64, assert_loss_vs_fp64
    from _trainer_pairs import trl_head_in_fp64

    out = {}
    for case, tr in trainers_.items():
        dev = tr.accelerator.device
        inputs = {k: v.to(dev) for k, v in batches[f"nf4_{case}"]["global"].items()}
        res = step(tr, tr.model, inputs)
        assert res["calls"] > 0 and res["fallbacks"] == [], (case, res["calls"], res["fallbacks"])
        n = to_twin(tr.model)
        assert n > 0 and not linear4bit_layers(tr.model), case
        # quantization happened: the twin's weights are not the fp32 ones they came from
        fp32 = _fp32_weights(out_dir, BASES[case])
        twin_w = {name.split("base_model.model.")[-1].replace(".base_layer", ""): p
                  for name, p in tr.model.named_parameters()
                  if "proj.base_layer.weight" in name}
        assert twin_w and all(
            (fp32[k].to(p.device) - p).abs().max() > 1e-3 * fp32[k].abs().max()
            for k, p in twin_w.items()), case
        twin32 = step(tr, tr.model, inputs)
        # the bf16 adapter weights (module docstring) in fp32, exactly, as `in_fp64` takes them
        for p in tr.model.parameters():
            if p.dtype == torch.bfloat16:
                p.data = p.data.float()
        with trl_head_in_fp64(tr):
            twin64 = step(tr, tr.model, inputs)
        assert_loss_vs_fp64(res["loss"], twin32["loss"], twin64["loss"], n_terms=64,
                            what=f"nf4 {case}: 4-bit loss vs the twin's")
        assert_grads_vs_fp64(res["grads"], twin32["grads"], twin64["grads"],
                             what=f"nf4 {case}: 4-bit grad vs the twin's")
        res["fp64"] = twin64["loss"], twin64["grads"]
        res["fp64_metrics"] = twin64["metrics"]
        out[f"nf4_{case}"] = res
    return out


def prepare(tok, out_dir: str, world: int, sft_batch: dict, *, device: str = "cpu"):
    """Quantize the bases, build the single-process trainers and the global batches (to be
    saved into inputs.pt before the ranks start). Returns (trainers by case, batches by
    "nf4_<case>")."""
    quantize_bases(tok, out_dir, device)
    trainers_ = {case: build(case, tok, out_dir, 1, device=device) for case in CASES}
    batches = {f"nf4_{case}": batch(case, tok, tr, world, sft_batch)
               for case, tr in trainers_.items()}
    return trainers_, batches


def rank_results(rank: int, world: int, tok, batches: dict, out_dir: str, device: str) -> dict:
    """Scenario ddp_nf4 on rank `rank`: each case's trainer under accelerate's DDP wrapper, one
    step on this rank's rows inside `no_sync()` (the rank-local gradient) and one all-reduced."""
    out = {}
    for case in CASES:
        tr = build(case, tok, out_dir, world, device=device)
        ddp = tr.accelerator.prepare_model(tr.model)
        assert isinstance(ddp, torch.nn.parallel.DistributedDataParallel), type(ddp)
        inputs = {k: v.to(tr.accelerator.device)
                  for k, v in batches[f"nf4_{case}"]["ranks"][rank].items()}
        with ddp.no_sync():
            local = step(tr, ddp, inputs)
        res = step(tr, ddp, inputs)
        res["local"], res["synced"] = local["grads"], res.pop("grads")
        assert len(linear4bit_layers(ddp)) > 0  # the 4-bit layers ran under DDP
        out[f"nf4_{case}"] = res
    return out
