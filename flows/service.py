"""Serve one base model for LoRA training over the Tinker API; the official `tinker` SDK is the client.

    python -m flows.service                                          # the default model on 127.0.0.1:8000
    python -m flows.service --model-id hf://Qwen/Qwen2.5-0.5B-Instruct --max-tenants 16 --port 8080
    python -m flows.service --nproc-per-node 2                       # the model in 2 worker processes

A client (another shell, another machine):

    export TINKER_BASE_URL=http://127.0.0.1:8000 TINKER_API_KEY=tml-anything
    python -c "import tinker; tc = tinker.ServiceClient().create_lora_training_client(base_model='NAME', rank=8)"

NAME is what the server prints at start (the model id unless --model-name gives another). Every API key
of the form tml-... is its own tenant namespace unless --api-keys-file lists the keys allowed.
`get_tokenizer()` resolves the tokenizer id the server reports: the model's local folder by default (a
client on this machine loads it offline); give --tokenizer-id (e.g. a hub name) for clients elsewhere.
"""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from flows.cli import OptionParser
from flows.params import DEFAULT_MODEL
from twinkle_core.errors import UserError


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = OptionParser(prog="python -m flows.service", description=__doc__.splitlines()[0])
    parser.add_argument("--model-id", default=DEFAULT_MODEL, help="the base model (ms://, hf://, pkg://, a path)")
    parser.add_argument("--model-name", help="the name clients pass as base_model (default: the model id)")
    parser.add_argument("--tokenizer-id", help="what get_tokenizer() loads on the client (default: the local folder)")
    parser.add_argument("--backend", default="transformers", choices=["transformers", "megatron"])
    parser.add_argument("--max-tenants", type=int, default=8, help="training models held at once")
    parser.add_argument("--max-lora-rank", type=int, default=64)
    parser.add_argument("--max-length", type=int, default=4096, help="longest datum, in tokens")
    parser.add_argument("--max-request-mb", type=int, default=64, help="largest request body")
    parser.add_argument("--precision", default="auto", choices=["auto", "bf16", "fp16", "no"])
    parser.add_argument("--nproc-per-node", type=int, default=1, help="worker processes holding the model")
    parser.add_argument("--state-dir", type=Path, default=Path("service-state"),
                        help="where save_state writes (per API key); states outlive the server")
    parser.add_argument("--api-keys-file", type=Path, help="allowed API keys, one per line (default: any tml-... key)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args(argv)
    for option in ("max_tenants", "max_lora_rank", "max_length", "max_request_mb", "nproc_per_node"):
        if getattr(args, option) < 1:
            parser.error(f"--{option.replace('_', '-')} must be >= 1")
    if args.backend == "megatron":
        parser.error("--backend megatron: the service runs on the transformers backend for now "
                     "(MultiLoraMegatronModel is not wired to it yet)")
    return args


def _api_keys(path: Path | None) -> frozenset[str] | None:
    if path is None:
        return None
    if not path.is_file():
        raise UserError(f"--api-keys-file {path}: no such file")
    keys = frozenset(line.strip() for line in path.read_text().splitlines() if line.strip() and not line.startswith("#"))
    bad = sorted(k for k in keys if not k.startswith("tml-"))
    if not keys or bad:
        raise UserError(f"--api-keys-file {path}: " + ("no keys" if not keys else
                        f"{len(bad)} key(s) do not start with 'tml-' (the SDK sends no other)"))
    return keys


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    import uvicorn

    from twinkle_core.hub.models import resolve_model
    from twinkle_service.app import ServiceConfig, create_app

    try:
        keys = _api_keys(args.api_keys_file)
        path = resolve_model(args.model_id).path
    except UserError as error:
        print(f"service: {error}", file=sys.stderr)
        return 1
    config = ServiceConfig(model_id=args.model_id, model_name=args.model_name or args.model_id,
                           tokenizer_id=args.tokenizer_id or str(path), max_tenants=args.max_tenants,
                           max_lora_rank=args.max_lora_rank, max_length=args.max_length,
                           max_request_bytes=args.max_request_mb << 20, api_keys=keys,
                           mixed_precision=args.precision, nproc_per_node=args.nproc_per_node,
                           state_dir=args.state_dir.resolve())
    print(f"service: serving {config.model_name!r} on http://{args.host}:{args.port} "
          f"(TINKER_BASE_URL; base_model={config.model_name!r})", flush=True)
    uvicorn.run(create_app(config), host=args.host, port=args.port, log_level="warning")
    return 0


if __name__ == "__main__":
    sys.exit(main())
