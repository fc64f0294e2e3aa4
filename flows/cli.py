"""A command line for any flow whose parameters are one flat pydantic model.

    python -m flows.sft --help
    python -m flows.sft --config run.yaml --lr 1e-4 --epochs 2

Values come from the model's defaults, then the YAML/JSON file, then the flags.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import yaml
from pydantic import BaseModel, ValidationError


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def build_parser(model: type[BaseModel], description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--config", type=Path, help="YAML or JSON file with any of the options below.")
    for name, field in model.model_fields.items():
        help_text = field.description or ""
        # Every flag's argparse default is None (unset: the file's or the model's value wins), so the model's
        # own default is written here, once; None means "decided by the run" and the help text says how.
        if not field.is_required() and field.default is not None:
            help_text += f" (default: {field.default})"
        parser.add_argument(_flag(name), dest=name, default=None, metavar=name.upper(), help=help_text or None)
    return parser


def _coerce(model: type[BaseModel], name: str, raw: str):
    """Flags arrive as text: parse JSON-looking values (lists, numbers, booleans), else keep the text."""
    annotation = str(model.model_fields[name].annotation)
    if raw.lower() in ("true", "false") and "bool" in annotation:
        return raw.lower() == "true"
    if "list" in annotation and not raw.startswith("[") and "," in raw:
        return [part.strip() for part in raw.split(",") if part.strip()]
    try:
        return json.loads(raw) if raw[:1] in "[{" else raw
    except json.JSONDecodeError:
        return raw


def run_from_cli(flow, model: type[BaseModel], argv: list[str] | None, doc: str) -> int:
    """`python -m flows.<name>`: the options into the flow's parameters, the flow run, its summary printed.

    `--resume RUN_FOLDER` runs again in an earlier run's folder, from the parameters it started with (flags
    may change what does not affect training): training continues from its last saved state."""
    config, resume = parse_args(model, argv, description=doc.splitlines()[0])
    from flows.run_folder import resuming

    with resuming(resume):
        result = flow(config)
    print("\n" + result["summary"], flush=True)
    return 0


def parse_config(model: type[BaseModel], argv: list[str] | None, description: str) -> BaseModel:
    return parse_args(model, argv, description)[0]


def parse_args(model: type[BaseModel], argv: list[str] | None, description: str) -> tuple[BaseModel, Path | None]:
    """The flow's parameters (defaults, then the resumed run's, the --config file, the flags) and the run
    folder to resume in (None: a new one)."""
    parser = build_parser(model, description)
    if getattr(model, "resumable", False):
        parser.add_argument("--resume", type=Path, metavar="RUN_FOLDER",
                            help="Continue an earlier run in its folder (output_dir/<time>-<run name>) from its "
                                 "last training state, with the parameters it started with.")
    args = parser.parse_args(argv)
    resume = getattr(args, "resume", None)
    values: dict = {}
    if resume is not None:
        from flows.run_folder import resume_parameters

        resume = resume.resolve()
        values.update(resume_parameters(resume, model.kind))
    if args.config is not None:
        if not args.config.exists():
            raise SystemExit(f"--config {args.config}: no such file")
        values.update(read_config_file(args.config))
        unknown = sorted(set(values) - set(model.model_fields))
        if unknown:
            raise SystemExit(f"--config {args.config}: unknown options {unknown}; see --help for the valid ones")
    values.update({k: _coerce(model, k, v) for k, v in vars(args).items()
                   if k not in ("config", "resume") and v is not None})
    try:
        return model.model_validate(values), resume
    except ValidationError as err:
        raise SystemExit("invalid options:\n" + "\n".join(_describe(error) for error in err.errors())) from None


def read_config_file(path: Path) -> dict:
    """The options in a YAML or JSON file (JSON is YAML), or an error naming the file, line and column."""
    try:
        values = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f", line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err)
        raise SystemExit(f"--config {path}{where}: not valid YAML: {problem}") from None
    except UnicodeDecodeError as err:
        raise SystemExit(f"--config {path}: not UTF-8 text (byte {err.start})") from None
    if values is None:
        return {}
    if not isinstance(values, dict):
        raise SystemExit(f"--config {path}: the top level is a {type(values).__name__}, not a mapping of options "
                         "(write one `option: value` per line)")
    return values


def _describe(error: dict) -> str:
    """One pydantic error as the user wrote it: the option and what is wrong (check_run lists its own)."""
    where = ".".join(str(part) for part in error["loc"])
    message = error["msg"].removeprefix("Value error, ")
    return f"  {where}: {message}" if where else f"  {message}"
