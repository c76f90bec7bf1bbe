"""Supervised fine-tuning (LoRA by default) through `trainers.SFTTrainer`.

With no arguments: a tiny Llama built offline learns the built-in arithmetic task ("7+5=" ->
"12", as chat turns) on CPU in under a minute; greedy accuracy is printed before and after.

The command line is TRL's: every field of trl.SFTConfig and trl.ModelConfig is a flag
(--learning_rate or --learning-rate), `--config recipe.yaml` sets any of them (see recipes/),
and the command line wins over the file. Defaults that depend on --model (tiny, smollm2,
other: the learning rate among them) come from scripts/_presets.py; --help shows the ones for
the --model given. Short aliases: --steps, --lr, --batch-size, --grad-accum, --lora-targets.

    python scripts/train_sft.py
    python scripts/train_sft.py --model smollm2
    python scripts/train_sft.py --config recipes/sft_tiny.yaml
    python scripts/train_sft.py --max_steps 50 --output_dir outputs/sft-50 && \\
        python scripts/train_sft.py --max_steps 100 --output_dir outputs/sft-50 --resume
    # a real model on one GPU: bf16, 4-bit NF4 base + LoRA on all linear layers
    python scripts/train_sft.py --model Qwen/Qwen2.5-0.5B-Instruct \\
        --dataset trl-lib/Capybara --max_steps 500 --max_length 1024

--dataset takes a hub id, a .json/.jsonl file or a saved dataset directory with a `messages`
column, `prompt` + `completion` columns, or a `text` column. Each run has its own output
directory, outputs/sft-<model> unless --output_dir is given, with run.json (the model and the
settings that shape the weights), checkpoint-*/, the final LoRA adapter
(adapter_model.safetensors), metrics.json and metrics.png (loss, mean token accuracy and
entropy per step).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

import _cli
import _common as C
import _rundir

SFT_FORMATS = (("messages",), ("prompt", "completion"), ("text",))


def sft_dataset(args):
    """(train, eval_rows): the built-in arithmetic rows, or --dataset validated for SFT."""
    import datasets

    if args.dataset is None:
        train, held, _ = C.arithmetic_split(args.eval_size, seed=args.seed,
                                            max_operand=args.max_operand)
        prompt = C.task_prompt(args.model)
        rows = C.arithmetic_rows(train, with_completion=True, prompt=prompt)
        for r in rows:
            del r["answer"]  # SFT trains on prompt + completion only
        return (datasets.Dataset.from_list(rows),
                C.arithmetic_rows(held, with_completion=False, prompt=prompt))
    ds = C.load_dataset_arg(args.dataset, args.dataset_split)
    for cols in SFT_FORMATS:
        if all(c in ds.column_names for c in cols):
            break
    else:
        raise C.UserError(
            f"--dataset {args.dataset!r} has columns {ds.column_names}; SFT needs 'messages', "
            "'prompt' + 'completion', or 'text'")
    return ds, None


# The settings that shape the weights, recorded in run.json by both scripts: the model, the
# data and the optimization. A resumed run may change max_steps (and save_steps) only.
TRAIN_RECORD = ("model", "dataset", "dataset_split", "max_operand", "eval_size", "seed",
                "use_peft", "lora_r", "lora_alpha", "lora_dropout", "lora_target_modules",
                "use_rslora", "use_dora", "lora_modules_to_save", "load_in_4bit", "dtype",
                "learning_rate", "lr_scheduler_type", "warmup_steps", "weight_decay",
                "max_grad_norm", "max_steps", "per_device_train_batch_size",
                "gradient_accumulation_steps")


@dataclass
class SFTScriptArguments:
    """This script's own arguments (the model, the task, the evaluation, the run directory)."""

    model: str = field(default="tiny", metadata={"help": C.MODEL_HELP})
    dataset: str | None = field(default=None, metadata={"help": C.DATASET_HELP})
    dataset_split: str = field(default="train", metadata={"help": "split to read from --dataset"})
    max_operand: int = field(default=9, metadata={"help": "built-in task: operands are 0..N"})
    eval_size: int = field(default=128, metadata={
        "help": "prompts in the greedy before/after evaluation, 0 disables"})
    resume: bool = field(default=False, metadata={"help": C.RESUME_HELP})
    overwrite_output_dir: bool = field(default=False, metadata={"help": C.OVERWRITE_HELP})


def parse(argv):
    """The namespace of every flag (see `_cli.parse`), checked."""
    import torch
    from trl import ModelConfig, SFTConfig

    parser = _cli.build_parser("sft", [SFTScriptArguments, SFTConfig, ModelConfig], __doc__)
    args = _cli.parse("sft", parser, argv, cuda=torch.cuda.is_available())
    C.check_common_args(args)
    C.check_model_fields(args)
    return args


def run_record(script: str, args, extra=()) -> dict:
    """What run.json holds: the script and every setting that shapes the weights; a default
    derived from max_steps (warmup_steps) as its rule, so a resumed run's new step count does
    not read as another setting."""
    import _presets

    def plain(k):
        if k in _presets.DERIVED and k not in args.explicit:
            return _presets.DERIVED[k][0]
        v = getattr(args, k, None)
        return v if v is None or isinstance(v, (bool, int, float, str, list)) else str(v)

    return {"script": script, **{k: plain(k) for k in (*TRAIN_RECORD, *extra)}}


def warm_start_config(args, *, output_dir: str):
    """The SFTConfig of train_grpo.py's warm start: its own step count, rate, batch size and
    length, a cosine schedule, no checkpoints; the rest (seed, precision, accumulation,
    checkpointing, logging, report_to) as the GRPO run's."""
    from trl import SFTConfig

    from trainers.config import checkpointing_kwargs

    steps = args.sft_warmup_steps
    return SFTConfig(
        output_dir=output_dir, max_steps=steps, learning_rate=args.sft_learning_rate,
        per_device_train_batch_size=args.sft_batch_size, max_length=args.sft_max_length,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        lr_scheduler_type="cosine", warmup_steps=max(1, steps // 20), save_strategy="no",
        logging_steps=args.logging_steps, report_to=args.report_to, seed=args.seed,
        data_seed=args.data_seed, bf16=args.bf16, use_cpu=args.use_cpu,
        dataloader_num_workers=args.dataloader_num_workers, disable_tqdm=True,
        **checkpointing_kwargs(args.activation_checkpointing))


def sft_trainer(model, tokenizer, train, cfg, *, title: str = "", prefix: str = ""):
    """(a `trainers.SFTTrainer`, the `ProgressCallback` that logs its every step)."""
    from _checkpoints import manifest_callback
    from _progress import ProgressCallback

    _, SFTTrainer = C.trainer_classes()
    trainer = SFTTrainer(model=model, args=cfg, train_dataset=train, processing_class=tokenizer)
    cb = ProgressCallback(cfg.output_dir, ("loss", "mean_token_accuracy", "entropy"), prefix,
                          title)
    ProgressCallback.install(trainer, cb)
    trainer.add_callback(manifest_callback())  # after each save: its manifest, for --resume
    return trainer, cb


def time_line(this: float, whole: float, ckpt: str | None) -> str:
    """The summary's line on training time: this process's, and after --resume the run's."""
    if ckpt is None:
        return f"training time: {this:.0f} s"
    return (f"training time: {this:.0f} s in this process (resumed from {ckpt}), {whole:.0f} s "
            "over the whole run")


def run(args) -> dict:
    _rundir.check_writable(args.output_dir)
    ckpt = C.latest_checkpoint(args.output_dir) if args.resume else None
    _rundir.claim(args.output_dir, run_record("train_sft.py", args), resume=args.resume,
                  overwrite=args.overwrite_output_dir)
    C.setup_process(args)
    C.resume_save_steps(args, ckpt)
    from trl import SFTConfig

    cfg = _cli.build(SFTConfig, args)
    train, eval_rows = sft_dataset(args)
    model, tokenizer = C.load_model(args)
    model = C.wrap_lora(model, args)
    task = f"dataset {args.dataset}" if args.dataset else f"a+b, operands 0..{args.max_operand}"
    trainer, progress = sft_trainer(
        model, tokenizer, train, cfg,
        title=f"SFT · model {args.model} · task {task} · run {args.output_dir}")
    result = {}
    # the answer plus EOS fits in 8 tokens for the tiny model; a chat model may say more
    max_new = 8 if args.model == C.TINY else 24

    def accuracy(when):
        acc = C.greedy_eval(trainer.model, tokenizer, eval_rows, ["arithmetic"],
                            max_new_tokens=max_new)["arithmetic"]
        C.say(f"greedy accuracy {when} SFT: {acc:.3f}", flush=True)
        return acc

    if eval_rows:
        result["eval_before"] = accuracy("before")
    trainer.train(resume_from_checkpoint=ckpt)
    trainer.save_model(args.output_dir)
    if eval_rows:
        result["eval_after"] = accuracy("after")
    result["train_s"], result["train_s_whole_run"] = progress.train_seconds()
    C.say(time_line(result["train_s"], result["train_s_whole_run"], ckpt))
    C.say(f"adapter, metrics.json, metrics.png in {args.output_dir}")
    return result


def main(argv=None) -> int:
    return C.run_main("train_sft.py", parse, run, argv)


if __name__ == "__main__":
    sys.exit(main())
