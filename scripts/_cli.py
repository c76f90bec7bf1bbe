"""The train scripts' command line: TRL's conventions, with friendly defaults.

`TrlParser` over the trainer's config (`trainers.GRPOConfig` or `trl.SFTConfig`), TRL's
`ModelConfig` and the script's own dataclass: every TRL field is a flag (`--learning_rate`, or
`--learning-rate`), `--config recipe.yaml` sets any of them, and the command line wins over the
file. The scripts' defaults (`_presets.py`: per-model presets, the device's choices) become
the parser's defaults before the file and the command line are read, so `--help` shows the
value a run would use, and a preset never overrides a value the user set.

A few short flags of earlier versions stay as aliases (`--steps` for `--max_steps`, `--lr`,
`--batch-size`, `--grad-accum`, `--lora-targets a,b`, `--no-load-in-4bit`).
"""

from __future__ import annotations

import argparse
import dataclasses
import os

import _common as C
import _presets as P

# (flags, dest, argparse keywords): shorter names for TRL fields.
ALIASES = [
    (("--steps",), "max_steps", {"type": int}),
    (("--lr",), "learning_rate", {"type": float}),
    (("--batch-size", "--batch_size"), "per_device_train_batch_size", {"type": int}),
    (("--grad-accum", "--grad_accum"), "gradient_accumulation_steps", {"type": int}),
    (("--lora-targets", "--lora_targets"), "lora_target_modules",
     {"type": lambda s: [t.strip() for t in s.split(",") if t.strip()],
      "metavar": "NAMES"}),
    (("--no-load-in-4bit", "--no_load_in_4bit"), "load_in_4bit",
     {"action": "store_const", "const": False, "nargs": None}),
]


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Every flag's default in --help, and the docstring's commands as written."""


def build_parser(script: str, dataclass_types, doc: str):
    """A TrlParser over `dataclass_types` with the aliases and, in each preset field's help,
    the three presets."""
    from trl import TrlParser

    parser = TrlParser(dataclass_types, description=doc.split("\n\n")[0],
                       usage="%(prog)s [--config RECIPE.yaml] [--model MODEL] [--FIELD VALUE ...]",
                       epilog=doc.split("\n\n", 1)[1], formatter_class=_HelpFormatter,
                       allow_abbrev=False)
    dests = {a.dest for a in parser._actions}
    for flags, dest, kw in ALIASES:
        if dest in dests:
            kw = {k: v for k, v in kw.items() if v is not None or k != "nargs"}
            parser.add_argument(*flags, dest=dest, default=argparse.SUPPRESS,
                                help=f"alias of --{dest}", **kw)
    for action in parser._actions:
        presets = P.preset_help(script, action.dest)
        first = action.option_strings and action.option_strings[0] == f"--{action.dest}"
        if presets and first:
            action.help = f"{action.help or ''} [presets: {presets}]".strip()
        elif action.dest in P.DERIVED and first:
            action.help = f"{action.help or ''} [unset: {P.DERIVED[action.dest][0]}]".strip()
        elif not action.help:
            action.help = " "  # argparse shows a default only beside some help text
    return parser


def _yaml_config(argv: list[str]) -> tuple[list[str], dict, str | None]:
    """(argv without --config PATH, the file's mapping, PATH)."""
    argv = list(argv)
    path = None
    for i, a in enumerate(argv):
        if a == "--config" and i + 1 < len(argv):
            path = argv[i + 1]
            del argv[i : i + 2]
            break
        if a.startswith("--config="):
            path = a.split("=", 1)[1]
            del argv[i]
            break
    if path is None:
        return argv, {}, None
    import yaml

    try:
        with open(path) as f:
            config = yaml.safe_load(f)
    except (OSError, yaml.YAMLError) as e:
        raise C.UserError(f"--config {path}: {str(e).splitlines()[0]}") from None
    if config is None:
        config = {}
    if not isinstance(config, dict):
        raise C.UserError(f"--config {path}: expected a YAML mapping of field: value")
    return argv, config, path


def explicit_dests(parser, argv: list[str]) -> set[str]:
    """The fields that `argv` sets, however spelled (underscores, dashes, an alias, --x=v):
    argv parsed once more with every default suppressed, so only what it names lands."""
    saved = [(a, a.default) for a in parser._actions]
    saved_defaults = parser._defaults
    try:
        for a, _ in saved:
            a.default = argparse.SUPPRESS
        parser._defaults = {}
        ns, _ = parser.parse_known_args([a for a in argv if a not in ("-h", "--help")])
    finally:
        for a, d in saved:
            a.default = d
        parser._defaults = saved_defaults
    return set(vars(ns))


def parse(script: str, parser, argv: list[str], *, cuda: bool):
    """The parsed flags as one namespace (every dataclass's fields), with `explicit`: the
    names the user set, by flag or in the file.

    Order of precedence, lowest first: the dataclasses' defaults, the script's defaults for
    the --model given, the --config file, the command line."""
    argv, config, path = _yaml_config(argv)
    if "env" in config:
        env = config.pop("env")
        if not isinstance(env, dict):
            raise C.UserError(f"--config {path}: `env` must be a mapping")
        os.environ.update({k: str(v) for k, v in env.items()})
    dests = {a.dest for a in parser._actions}
    unknown = sorted(set(config) - dests)
    if unknown:
        raise C.UserError(f"--config {path}: unknown field(s) {unknown}; `--help` lists them")
    explicit = explicit_dests(parser, argv) | set(config)
    pre, _ = parser.parse_known_args([a for a in argv if a not in ("-h", "--help")])
    model = _model_arg(pre, config, explicit)
    found = P.defaults(script, P.model_kind(model), cuda=cuda, dataset=bool(
        getattr(pre, "dataset", None) or config.get("dataset")))
    found["output_dir"] = default_output_dir(script, model)
    parser.set_defaults(**{k: v for k, v in found.items() if k in dests})
    parser.set_defaults(**config)
    ns = parser.parse_args(argv)
    ns.model = _model_arg(ns, {}, explicit)
    for name, (_, rule) in P.DERIVED.items():
        if getattr(ns, name, 0) is None and isinstance(ns.max_steps, int):
            setattr(ns, name, rule(ns.max_steps))
    if getattr(ns, "data_seed", 0) is None:
        ns.data_seed = ns.seed  # the data order follows --seed unless set on its own
    # One field for the scripts whatever this transformers calls it: `activation_checkpointing`
    # where TrainingArguments has it, else (or when only the older name was given) the value
    # of `gradient_checkpointing`.
    if not hasattr(ns, "activation_checkpointing") or (
            "gradient_checkpointing" in explicit and "activation_checkpointing" not in explicit):
        ns.activation_checkpointing = ns.gradient_checkpointing
    ns.explicit = explicit
    return ns


def _model_arg(ns, config: dict, explicit: set[str]) -> str:
    """--model, or TRL's --model_name_or_path (a recipe's usual key) when only that is set."""
    model = config.get("model", getattr(ns, "model", "tiny"))
    other = config.get("model_name_or_path", getattr(ns, "model_name_or_path", None))
    if other and "model" not in explicit:
        return other
    if other and other != model:
        raise C.UserError(f"--model {model!r} and --model_name_or_path {other!r} disagree: "
                          "set one")
    return model


def default_output_dir(script: str, model: str) -> str:
    """outputs/<script>-<model>: one directory per model by default, e.g. outputs/grpo-tiny,
    outputs/grpo-smollm2, outputs/grpo-Qwen2.5-0.5B-Instruct."""
    import re

    name = os.path.basename(os.path.normpath(os.path.expanduser(model))) or "model"
    return os.path.join("outputs", f"{script}-" + re.sub(r"[^\w.-]+", "_", name))


def build(cls, ns, **overrides):
    """An instance of dataclass `cls` from the namespace's fields of that name (and
    `overrides`); a ValueError from its own checks becomes a UserError."""
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    kw = {k: v for k, v in vars(ns).items() if k in names}
    try:
        return cls(**{**kw, **overrides})
    except ValueError as e:
        raise C.UserError(f"{cls.__name__}: {str(e).splitlines()[0]}") from None
