"""Export a registered model for inference engines.

    python -m flows.export --model models:/NAME@champion --to hf-merged --output DIR   # safetensors + tokenizer
    python -m flows.export --model models:/NAME@champion --to gguf --output DIR        # DIR/NAME.gguf (F32)

hf-merged: an adapter version is merged into its base; plain AutoModelForCausalLM.from_pretrained(DIR) and
vLLM load the folder (AutoModelForImageTextToText for a vision-language model: the folder keeps its image and
video processor files). gguf: Llama-family architectures only (twinkle_core.convert.gguf_export says why
another is refused); llama.cpp, Ollama and transformers (gguf_file=) read it. No Prefect run is started.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from flows.cli import OptionParser
from twinkle_core.errors import UserError

FORMATS = ("hf-merged", "gguf")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = OptionParser(prog="python -m flows.export", description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="models:/NAME@ALIAS or models:/NAME/VERSION")
    parser.add_argument("--to", required=True, choices=FORMATS, help="the format to write")
    parser.add_argument("--output", required=True, type=Path, help="a new or empty folder")
    return parser.parse_args(argv)


def export(model_uri: str, to: str, output: Path) -> Path:
    """Write the registered version `model_uri` to `output` as `to`; return the folder or the .gguf file."""
    from twinkle_core.convert.gguf_export import write_gguf
    from twinkle_core.hub import copy_processor_files
    from twinkle_core.tracking.registered import opened_registered, parse_model_uri

    if output.exists() and any(output.iterdir()):
        raise UserError(f"--output {str(output)!r} is not empty; give a new or empty folder")
    name, alias = parse_model_uri(model_uri)
    with opened_registered(name, alias, dtype="auto") as (model, tokenizer, folder):
        if to == "hf-merged":  # a VL model's folder keeps its image/video processor settings
            output.mkdir(parents=True, exist_ok=True)
            copy_processor_files(folder, output)
    if hasattr(model, "merge_and_unload"):  # an adapter version: fold it into its base
        model = model.merge_and_unload()
    if to == "gguf":  # refuses a non-Llama architecture with the reason
        return write_gguf(model, tokenizer, output / f"{name}.gguf", name=name)
    model.save_pretrained(output, safe_serialization=True)
    tokenizer.save_pretrained(output)
    return output


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    try:
        written = export(args.model, args.to, args.output)
    except UserError as error:
        print(f"export: {error}", file=sys.stderr)
        return 1
    print(f"wrote {written} ({time.perf_counter() - started:.1f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
