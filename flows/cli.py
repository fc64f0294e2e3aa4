"""A command line for any flow whose parameters are one flat pydantic model.

    python -m flows.sft --help
    python -m flows.sft --config run.yaml --lr 1e-4 --epochs 2

Values come from the model's defaults, then the YAML/JSON file, then the flags.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import sys
from pathlib import Path
from typing import Callable, Iterator, NamedTuple

import yaml
from pydantic import BaseModel, ValidationError

from twinkle_core.errors import user_error


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def build_parser(model: type[BaseModel], description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--config", type=Path, help="YAML or JSON file with any of the options below.")
    parser.add_argument("--debug", action="store_true",
                        help="Show the traceback of an error the run reports (bad id, data set or option); the "
                             "Prefect log has it either way.")
    for name, field in model.model_fields.items():
        help_text = (field.description or "").replace("%", "%%")  # argparse formats help with %
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
    args = parse_args(model, argv, description=doc.splitlines()[0])
    from flows.run_folder import resuming

    def run() -> dict:
        with resuming(args.resume):
            return flow(args.config)

    result = report_user_errors(run, flow.name, args.debug)
    if result is None:
        return 1
    print("\n" + result["summary"], flush=True)
    return 0


def report_user_errors(run: Callable[[], dict], name: str, debug: bool) -> dict | None:
    """`run()`; an error the user caused (bad id, data set, option...) is printed as its message alone and
    gives None. Without --debug the terminal shows no traceback for it; bugs keep theirs."""
    with contextlib.ExitStack() as stack:
        if not debug:
            stack.enter_context(_quiet_user_error_tracebacks())
        try:
            return run()
        except Exception as exc:
            error = user_error(exc)
            if error is None or debug:
                raise
    print(f"\n{name} failed: {error}\n(--debug shows the traceback)", file=sys.stderr, flush=True)
    return None


class _DropUserErrorTracebacks(logging.Filter):
    """A terminal handler's filter: a record carrying a user's error (Prefect's "Task run failed with
    exception" and "Encountered exception during execution", each with its traceback) is left out."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and user_error(record.exc_info[1]))


@contextlib.contextmanager
def _quiet_user_error_tracebacks() -> Iterator[None]:
    """Filter the terminal's log handlers (not Prefect's API handler: the run's log in the UI keeps all)."""
    quiet = _DropUserErrorTracebacks()
    loggers = [logging.getLogger()] + [logger for logger in logging.root.manager.loggerDict.values()
                                       if isinstance(logger, logging.Logger)]
    handlers = {id(h): h for logger in loggers for h in logger.handlers
                if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler)}
    for handler in handlers.values():
        handler.addFilter(quiet)
    try:
        yield
    finally:
        for handler in handlers.values():
            handler.removeFilter(quiet)


class CliArgs(NamedTuple):
    config: BaseModel  # the flow's parameters
    resume: Path | None  # the run folder to resume in (None: a new one)
    debug: bool = False  # tracebacks for the user's errors too


def parse_config(model: type[BaseModel], argv: list[str] | None, description: str) -> BaseModel:
    return parse_args(model, argv, description).config


def parse_args(model: type[BaseModel], argv: list[str] | None, description: str) -> CliArgs:
    """The flow's parameters (defaults, then the resumed run's, the --config file, the flags), the run
    folder to resume in and --debug."""
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
                   if k not in ("config", "resume", "debug") and v is not None})
    try:
        return CliArgs(model.model_validate(values), resume, args.debug)
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
