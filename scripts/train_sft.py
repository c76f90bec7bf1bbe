"""Supervised fine-tuning (LoRA by default) through `trainers.SFTTrainer`.

With no arguments: a tiny Llama built offline learns the built-in arithmetic task ("7+5=" ->
"12", as chat turns) on CPU in under a minute; greedy accuracy is printed before and after.

    python scripts/train_sft.py
    python scripts/train_sft.py --model smollm2 --steps 40 --batch-size 8 --lr 2e-4
    python scripts/train_sft.py --steps 50 --output-dir outputs/sft && \\
        python scripts/train_sft.py --steps 100 --output-dir outputs/sft --resume
    # a real model on one GPU: bf16, 4-bit NF4 base + LoRA on all linear layers
    python scripts/train_sft.py --model Qwen/Qwen2.5-0.5B-Instruct \\
        --dataset trl-lib/Capybara --steps 500 --batch-size 8 --lr 2e-4 --max-length 1024

--dataset takes a hub id, a .json/.jsonl file or a saved dataset directory with a `messages`
column, `prompt` + `completion` columns, or a `text` column. The output directory gets
checkpoint-*/, the final LoRA adapter (adapter_model.safetensors), metrics.json and
metrics.png (loss per step).
"""

from __future__ import annotations

import argparse
import os
import sys

import _common as C

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


def sft_trainer(model, tokenizer, train, args, *, output_dir: str, steps: int, lr: float,
                save_steps: int | None, batch_size: int | None = None, prefix: str = ""):
    """A `trainers.SFTTrainer` logging every step through `ProgressCallback`."""
    import torch
    from _checkpoints import manifest_callback
    from _progress import ProgressCallback
    from trl import SFTConfig

    _, SFTTrainer = C.trainer_classes()
    cuda = torch.cuda.is_available()
    cfg = SFTConfig(
        output_dir=output_dir,
        max_steps=steps,
        learning_rate=lr,
        per_device_train_batch_size=batch_size or args.batch_size,
        gradient_accumulation_steps=args.grad_accum,
        lr_scheduler_type="cosine",
        warmup_steps=max(1, steps // 20),
        max_length=args.max_length,
        save_strategy="steps" if save_steps else "no",
        save_steps=save_steps or 500,
        **C.trainer_common_kw(args, cuda),
    )
    trainer = SFTTrainer(model=model, args=cfg, train_dataset=train, processing_class=tokenizer)
    ProgressCallback.install(trainer, ProgressCallback(output_dir, ("loss", "mean_token_accuracy",
                                                                    "entropy"), prefix))
    trainer.add_callback(manifest_callback())  # after each save: its manifest, for --resume
    return trainer


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    C.add_common_args(p, steps=300, lr=3e-3, batch_size=32)
    p.add_argument("--max-length", type=int, default=1024, help="truncate sequences to this")
    p.add_argument("--max-operand", type=int, default=None,
                   help="built-in task: operands are 0..N (default 9; 20 for smollm2)")
    return p


def run(args) -> dict:
    if args.max_operand is None:
        args.max_operand = 20 if args.model == C.SMOLLM2 else 9
    if args.max_operand < 0:
        raise C.UserError(f"--max-operand must be >= 0, got {args.max_operand}")
    C.check_common_args(args)
    C.setup_process(args)
    args.output_dir = args.output_dir or os.path.join("outputs", "sft")
    ckpt = C.latest_checkpoint(args.output_dir) if args.resume else None
    C.resume_save_steps(args, ckpt)
    train, eval_rows = sft_dataset(args)
    model, tokenizer = C.load_model(args)
    model = C.wrap_lora(model, args)
    trainer = sft_trainer(model, tokenizer, train, args, output_dir=args.output_dir,
                          steps=args.steps, lr=args.lr,
                          save_steps=args.save_steps or max(1, args.steps // 4))
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
    C.say(f"adapter, metrics.json, metrics.png in {args.output_dir}")
    return result


def main(argv=None) -> int:
    return C.run_main(build_parser, run, argv)


if __name__ == "__main__":
    sys.exit(main())
