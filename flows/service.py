"""Serve one base model for LoRA training over the Tinker API; the official `tinker` SDK is the client.

    python -m flows.service                                          # the default model on 127.0.0.1:8000
    python -m flows.service --model-id hf://Qwen/Qwen2.5-0.5B-Instruct --max-tenants 16 --port 8080
    python -m flows.service --nproc-per-node 2                       # the model in 2 worker processes
    python -m flows.service --fsdp --nproc-per-node 2                # each worker holds half of every weight
    python -m flows.service --backend megatron --nproc-per-node 2 --tp-size 2    # the base split over 2 ranks
    python -m flows.service --fsdp --nproc-per-node 8 --nnodes 2 --rdzv-endpoint HOST0:29500   # machine 0: HTTP
    python -m flows.service --fsdp --nproc-per-node 8 --nnodes 2 --rdzv-endpoint HOST0:29500 --node-rank 1

A client (another shell, another machine):

    export TINKER_BASE_URL=http://127.0.0.1:8000 TINKER_API_KEY=tml-anything
    python -c "import tinker; tc = tinker.ServiceClient().create_lora_training_client(base_model='NAME', rank=8).result()"

NAME is what the server prints at start (the model id unless --model-name gives another). Every API key
of the form tml-... is its own tenant namespace unless --api-keys-file lists the keys allowed.
`get_tokenizer()` resolves the tokenizer id the server reports: the model's local folder by default (a
client on this machine loads it offline); give --tokenizer-id (e.g. a hub name) for clients elsewhere.
The same server runs as the `service` Prefect flow (deployment `service/default`): the flow run lasts as
long as the server, and cancelling it stops the server and its workers.
"""
from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Literal

from prefect import flow
from pydantic import ConfigDict, Field, model_validator

from flows.cli import parse_args, report_user_errors
from flows.params import DEFAULT_MODEL
from twinkle_core.config.fields import MachinesFields, ModelId
from twinkle_core.errors import UserError


WHERE = ("It sits beside the flows, above twinkle_core: this process serves HTTP (twinkle_service) and holds no "
         "model; the model lives in a worker tree started like the flows' training (torchrun with --nproc-per-node "
         "> 1; --fsdp shards the base over them, --backend megatron --tp-size N splits it over N); each session is "
         "an MLflow run. "
         "Clients: the tinker SDK with TINKER_BASE_URL and TINKER_API_KEY=tml-...; README section 'Training as a "
         "service (Tinker API)'.")


class ServiceOptions(MachinesFields):  # node 0 serves HTTP, the others only run their workers
    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    model_id: ModelId = Field(DEFAULT_MODEL, description="The base model (ms://, hf://, pkg://, a local path).")
    model_name: str | None = Field(None, description="The name clients pass as base_model (None: the model id).")
    tokenizer_id: str | None = Field(None, description="What get_tokenizer() loads on the client (None: the "
                                                       "model's local folder).")
    backend: Literal["transformers", "megatron"] = Field("transformers", description="transformers (each worker "
                                                         "holds the whole model) or megatron (megatron-core: "
                                                         "--tp-size splits the base over that many workers).")
    max_tenants: int = Field(8, ge=1, description="Training models held at once.")
    max_lora_rank: int = Field(64, ge=1, description="Largest LoRA rank a client may ask for.")
    max_length: int = Field(4096, ge=2, description="Longest datum (or prompt + max_tokens), in tokens.")
    max_request_mb: int = Field(64, ge=1, description="Largest request body, in MB.")
    precision: Literal["auto", "bf16", "fp16", "no"] = Field("auto", description="Mixed precision of the model.")
    nproc_per_node: int = Field(1, ge=1, description="Worker processes holding the model (torchrun beyond 1); "
                                                     "those tp_size leaves share each pass's rows.")
    tp_size: int = Field(1, ge=1, description="Tensor parallelism (backend megatron): each worker holds 1/tp_size "
                                              "of every layer.")
    fsdp: bool = Field(False, description="Shard the base over the workers with FSDP2 (backend transformers): each "
                                          "holds 1/nproc_per_node of every weight; the adapters take "
                                          "--max-tenants slots of --max-lora-rank allocated at start.")
    state_dir: Path = Field(Path("service-state"), description="Where save_state writes, per API key; states "
                                                              "outlive the server.")
    api_keys_file: Path | None = Field(None, description="Allowed API keys, one per line (None: any tml-... key).")
    track: bool = Field(True, description="Log each session as an MLflow run (MLFLOW_TRACKING_URI, else ./mlflow.db).")
    host: str = Field("127.0.0.1", description="Address to listen on (0.0.0.0 for other machines).")
    port: int = Field(8000, ge=1, le=65535, description="Port to listen on.")

    @model_validator(mode="after")
    def _layout(self) -> "ServiceOptions":
        if self.tp_size > 1 and self.backend != "megatron":
            raise ValueError(f"tp_size={self.tp_size}: tensor parallelism splits the base on backend megatron; "
                             "the transformers backend replicates the model on every worker (use --backend megatron)")
        if self.fsdp and self.backend != "transformers":
            raise ValueError("fsdp shards the transformers backend; backend megatron splits the base with --tp-size")
        if self.nproc_per_node % self.tp_size:
            raise ValueError(f"nproc_per_node={self.nproc_per_node} is not a multiple of tp_size={self.tp_size}")
        if self.backend == "megatron" and self.precision == "fp16":
            raise ValueError("precision fp16 is not supported on backend megatron (multi-tenant LoRA would need a "
                             "loss scaler per tenant in one backward); use bf16 or no")
        return self


def _api_keys(path: Path | None) -> frozenset[str] | None:
    if path is None:
        return None
    if not path.is_file():
        raise UserError(f"api_keys_file {path}: no such file")
    keys = frozenset(line.strip() for line in path.read_text().splitlines() if line.strip() and not line.startswith("#"))
    bad = sorted(k for k in keys if not k.startswith("tml-"))
    if not keys or bad:
        raise UserError(f"api_keys_file {path}: " + ("no keys" if not keys else
                        f"{len(bad)} key(s) do not start with 'tml-' (the SDK sends no other)"))
    return keys


def serve(options: ServiceOptions) -> None:
    """Load the model into its worker tree and serve until stopped (Ctrl-C, SIGTERM, a cancelled flow run)."""
    import uvicorn

    from twinkle_core.hub.models import resolve_model
    from twinkle_core.tracking.logger import tracking_uri
    from twinkle_service.app import ServiceConfig, create_app

    keys = _api_keys(options.api_keys_file)
    resolved = resolve_model(options.model_id)  # resolved (downloaded) here, once; the workers find it cached
    if options.node_rank > 0:
        _join(options)
        return
    path = resolved.path
    name = options.model_name or options.model_id
    config = ServiceConfig(model_id=options.model_id, model_name=name, tokenizer_id=options.tokenizer_id or str(path),
                           max_tenants=options.max_tenants, max_lora_rank=options.max_lora_rank,
                           max_length=options.max_length, max_request_bytes=options.max_request_mb << 20,
                           api_keys=keys, mixed_precision=options.precision, nproc_per_node=options.nproc_per_node,
                           backend=options.backend, tp_size=options.tp_size, fsdp=options.fsdp,
                           nnodes=options.nnodes, rdzv_endpoint=options.rdzv_endpoint, rdzv_id=options.rdzv_id,
                           state_dir=options.state_dir.resolve(),
                           tracking_uri=tracking_uri() if options.track else None, base_path=str(path),
                           base_content_hash=resolved.content_hash)
    print(f"service: serving {name!r} on http://{options.host}:{options.port} "
          f"(TINKER_BASE_URL; base_model={name!r})", flush=True)
    uvicorn.run(create_app(config), host=options.host, port=options.port, log_level="warning")


def _join(options: ServiceOptions) -> None:
    """Machine `node_rank` > 0: its workers join the tree of node 0 (which serves HTTP); until it stops them."""
    from twinkle_service.worker import join_tree, worker_args

    args = worker_args(options.model_id, options.max_tenants, options.max_lora_rank, options.max_length,
                       options.precision, options.backend, options.tp_size, options.fsdp, connect=None)
    print(f"service: node {options.node_rank} of {options.nnodes} joining the workers at {options.rdzv_endpoint}",
          flush=True)
    join_tree(args, options.nproc_per_node, options.nnodes, options.node_rank, options.rdzv_endpoint,
              options.rdzv_id)


@flow(name="service", log_prints=True)
def service(config: ServiceOptions) -> None:
    """The training service as a flow run: it lasts as long as the server."""
    serve(config)


def main(argv: list[str] | None = None) -> int:
    # A plain command line: no Prefect run (and no temporary Prefect server) around the server.
    args = parse_args(ServiceOptions, argv, description=__doc__.splitlines()[0] + " " + WHERE)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    return 0 if report_user_errors(lambda: serve(args.config) or {}, "service", args.debug) is not None else 1


if __name__ == "__main__":
    sys.exit(main())
