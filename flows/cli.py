"""A command line for any flow whose parameters are one flat pydantic model.

    python -m flows.sft --help
    python -m flows.sft --config run.yaml --lr 1e-4 --epochs 2

Values come from the model's defaults, then the YAML/JSON file, then the flags.
"""
from __future__ import annotations

import argparse
import contextlib
import difflib
import json
import logging
import os
import sys
from pathlib import Path
from typing import Callable, Iterator, NamedTuple

import yaml
from pydantic import BaseModel, ValidationError

from twinkle_core.errors import user_error


# Names other trainers (HF Trainer, trl) give our options: suggested first when one is mistyped.
ALIASES = {"learning_rate": "lr", "num_train_epochs": "epochs", "num_epochs": "epochs", "max_seq_length": "max_length",
           "per_device_train_batch_size": "batch_size", "model_name_or_path": "model_id", "lora_rank": "lora_r"}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _close_options(name: str, valid: list[str]) -> list[str]:
    """The valid options nearest to a mistyped `name` (flags or field names alike): an alias, then look-alikes."""
    key = name.lstrip("-").replace("-", "_")
    alias = ALIASES.get(key)
    aliased = [option for option in valid if alias and option.lstrip("-").replace("-", "_") == alias]
    return aliased or difflib.get_close_matches(name, valid, n=3)


def _did_you_mean(options: list[str]) -> str:
    return f"; did you mean {' or '.join(options)}?" if options else ""


class OptionParser(argparse.ArgumentParser):
    """argparse whose errors take two lines, not the whole usage; an unknown option names the closest valid ones.
    They exit with status 1, as the options' other errors (bad values, --config) do."""

    def __init__(self, *args, **kwargs):
        script = Path(sys.argv[0])
        if script.parent.name == "flows":  # `python -m flows.sft`, not argparse's "sft.py"
            kwargs.setdefault("prog", f"python -m flows.{script.stem}")
        super().__init__(*args, **kwargs)

    def parse_args(self, args=None, namespace=None):
        args = sys.argv[1:] if args is None else list(args)
        valid = [option for action in self._actions for option in action.option_strings if option.startswith("--")]
        # before argparse's own pass, which would first report a required option the typo was meant to give
        unknown = [flag for flag in (token.split("=", 1)[0] for token in args if token.startswith("--"))
                   if not any(option.startswith(flag) for option in valid)]  # a unique prefix is argparse's too
        if unknown:
            self.error("\n".join(f"unknown option {flag}" + _did_you_mean(_close_options(flag, valid))
                                 for flag in unknown))
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:  # a value with no option before it
            self.error(f"unexpected argument(s) {' '.join(extras)}; options are written --name value")
        return parsed

    def error(self, message: str):
        raise SystemExit(f"{self.prog}: {message}\n(--help lists every option)")


def build_parser(model: type[BaseModel], description: str) -> argparse.ArgumentParser:
    parser = OptionParser(description=description)
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
    from flows.local_server import end_server_with_this_process
    from flows.run_folder import resuming

    end_server_with_this_process()

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
        if debug:
            stack.enter_context(_worker_tracebacks())
        else:
            stack.enter_context(_quiet_user_error_tracebacks())
        try:
            return run()
        except Exception as exc:
            error = user_error(exc)
            if error is None or debug:
                raise
    print(f"\n{name} failed: {error}\n(--debug shows the traceback)", file=sys.stderr, flush=True)
    return None


@contextlib.contextmanager
def _worker_tracebacks():
    """--debug: the workers keep the traceback of a user's error too (twinkle_core.entry), for this run only."""
    previous = os.environ.get("TWINKLE_DEBUG")
    os.environ["TWINKLE_DEBUG"] = "1"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("TWINKLE_DEBUG", None)
        else:
            os.environ["TWINKLE_DEBUG"] = previous


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
            near = {name: _close_options(name, list(model.model_fields)) for name in unknown}
            hints = "".join(f"\n  {name}{_did_you_mean(near[name])}" for name in unknown if near[name])
            raise SystemExit(f"--config {args.config}: unknown options {unknown}; see --help for the valid ones{hints}")
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
