"""The HTTP side of the training service: the Tinker API routes the official `tinker` SDK calls.

Everything a key creates (sessions, training models, futures) belongs to that key: another key gets 404,
as if it did not exist. Calls that start model work return a future at once (`UntypedAPIFuture`); the
client polls `retrieve_future`, which waits up to `POLL_WAIT_S` for the result before answering
`try_again`. Request bodies are parsed with the SDK's own pydantic types and protobuf messages.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import re
import logging
import secrets
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote

import pydantic
import zstandard
from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, Response
from tinker import types
from tinker.types.checkpoint import ParsedCheckpointTinkerPath

from twinkle_core.tracking.model_logging import BaseModelRef
from twinkle_service.runner import FORWARD_BACKWARD, EngineRunner, Job
from twinkle_service.tracking import SessionRuns, key_hash
from twinkle_service.worker import RemoteEngine, WorkerTree
from twinkle_service.wire import MAX_TOPK, WireError, decode_forward_backward, encode_forward_backward, encode_sample

logger = logging.getLogger(__name__)

API = "/api/v1"
POLL_WAIT_S = 20.0
FUTURE_TTL_S = 600.0
PROTO = "application/x-protobuf"
REGISTER_KEY = "twinkle.register"  # save_weights_for_sampler(name, user_metadata={REGISTER_KEY: "MODEL"})
KEY_PREFIX = "tml-"  # the SDK refuses other keys before sending anything
_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,199}$")  # a saved state's or sampler's name


@dataclass
class ServiceConfig:
    model_id: str
    model_name: str  # what clients pass as base_model and what get_tokenizer resolves
    tokenizer_id: str | None = None
    max_tenants: int = 8
    max_lora_rank: int = 64
    max_length: int = 4096
    max_request_bytes: int = 64 << 20
    session_timeout_s: float = 120.0  # the SDK heartbeats every 10 s
    api_keys: frozenset[str] | None = None  # None: any key of the SDK's form, each its own namespace
    mixed_precision: str = "auto"
    nproc_per_node: int = 1  # worker processes holding the model (torchrun beyond one)
    backend: str = "transformers"  # or "megatron" (megatron-core; the base split over tp_size ranks)
    tp_size: int = 1
    fsdp: bool = False  # transformers backend: the base sharded over the workers by FSDP2
    nnodes: int = 1  # machines in the worker tree (this one is node 0; the others join at rdzv_endpoint)
    rdzv_endpoint: str | None = None
    rdzv_id: str = "twinkle"
    state_dir: Path = Path("service-state")  # saved training states, per key (they outlive the server)
    tracking_uri: str | None = None  # each session an MLflow run there (None: no MLflow)
    base_path: str | None = None  # the base's local folder and content hash: a registered adapter names them
    base_content_hash: str = ""


@dataclass
class Session:
    key: str
    last_seen: float
    models: set[str] = field(default_factory=set)


@dataclass
class TrainingModel:
    key: str
    session_id: str
    rank: int
    adapter: str  # the tenant's name in the engine (Tinker's model ids hold ':', adapter names may not)
    tag: str = "train_0"  # its metrics' prefix in the session's MLflow run
    steps: int = 0  # optim_steps so far
    last_loss: float | None = None  # the last cross_entropy forward_backward's loss per unit of weight


@dataclass
class SamplingSession:
    key: str
    sampler_id: str | None  # None: the base model
    clients: int = 1


@dataclass
class Pending:
    key: str
    future: asyncio.Future
    done_at: float = 0.0


class ApiError(HTTPException):
    """A 4xx with a message; the SDK must not retry it."""

    def __init__(self, status: int, message: str):
        super().__init__(status, detail=message, headers={"x-should-retry": "false"})


class Service:
    def __init__(self, config: ServiceConfig, runner: EngineRunner):
        self.config, self.runner = config, runner
        self.sessions: dict[str, Session] = {}
        self.models: dict[str, TrainingModel] = {}
        self.futures: dict[str, Pending] = {}
        self.sampler_paths: dict[str, tuple[str, str]] = {}  # tinker:// path: (key, sampler id)
        self.sampling: dict[str, SamplingSession] = {}
        self.runs = SessionRuns(config.tracking_uri, config.model_name) if config.tracking_uri else None
        self.loop: asyncio.AbstractEventLoop | None = None

    # ----- identity and ownership ------------------------------------------------------------------
    def key(self, request: Request) -> str:
        key = request.headers.get("x-api-key") or ""
        if not key.startswith(KEY_PREFIX) or (self.config.api_keys is not None and key not in self.config.api_keys):
            raise ApiError(401, "missing or unknown API key (send X-API-Key: tml-...; the SDK reads TINKER_API_KEY)")
        return key

    def session(self, key: str, session_id: str) -> Session:
        session = self.sessions.get(session_id)
        if session is None or session.key != key:
            raise ApiError(404, f"session {session_id!r} not found")
        session.last_seen = time.monotonic()
        return session

    def model(self, key: str, model_id: str) -> TrainingModel:
        model = self.models.get(model_id)
        if model is None or model.key != key:
            raise ApiError(404, f"model {model_id!r} not found")
        self.sessions[model.session_id].last_seen = time.monotonic()
        return model

    # ----- futures ---------------------------------------------------------------------------------
    def submit(self, key: str, kind: str, adapter: str, args, on_result=None, model_id: str | None = None) -> dict:
        request_id = uuid.uuid4().hex
        pending = self.futures[request_id] = Pending(key, self.loop.create_future())

        def done(result, error, category):  # on the engine thread
            self.loop.call_soon_threadsafe(self._complete, pending, result, error, category, on_result)

        self.runner.submit(Job(kind, adapter, args, done))
        return {"request_id": request_id, "model_id": model_id}

    @staticmethod
    def _complete(pending, result, error, category, on_result) -> None:
        if on_result is not None:
            result = on_result(result, error)
        if not pending.future.done():
            pending.done_at = time.monotonic()
            pending.future.set_result((result, error, category))

    async def retrieve(self, key: str, request_id: str) -> Response:
        pending = self.futures.get(request_id)
        if pending is None or pending.key != key:
            raise ApiError(404, f"future {request_id!r} not found")
        try:
            result, error, category = await asyncio.wait_for(asyncio.shield(pending.future), POLL_WAIT_S)
        except asyncio.TimeoutError:
            return JSONResponse({"type": "try_again", "request_id": request_id, "queue_state": "active"})
        if error is not None:
            return JSONResponse({"error": error, "category": category or "unknown"})
        if isinstance(result, bytes):
            return Response(result, media_type=PROTO)
        return JSONResponse(result)

    # ----- sessions --------------------------------------------------------------------------------
    def new_model(self, key: str, session: Session, session_id: str, model_seq_id: int, rank: int) -> str:
        """Reserve a training model slot under Tinker's own id for it (the SDK derives it as well)."""
        model_id = f"{session_id}:train:{model_seq_id}"
        if model_id in self.models:
            raise ApiError(400, f"model {model_id!r} exists already (model_seq_id {model_seq_id} was used)")
        if len(self.models) >= self.config.max_tenants:
            raise ApiError(400, f"this server holds --max-tenants={self.config.max_tenants} training models already; "
                                "try again when a session ends")
        self.models[model_id] = TrainingModel(key, session_id, rank, "t" + secrets.token_hex(8), f"train_{model_seq_id}")
        session.models.add(model_id)
        return model_id

    def made(self, model_id: str, response: dict):
        """The result callback of a job that creates a training model: its response, or the slot given back."""
        def done(result, error):
            if error is not None:
                self.forget_model(model_id)
                return None
            return response
        return done

    def forget_model(self, model_id: str) -> None:
        model = self.models.pop(model_id, None)
        if model is not None and model.session_id in self.sessions:
            self.sessions[model.session_id].models.discard(model_id)

    def state_dir(self, key: str, tinker_path: str, kind: str = "training") -> Path:
        """Where a `tinker://MODEL/weights/NAME` state (kind "training") or `.../sampler_weights/NAME` (kind
        "sampler") of this key lives: under the key's own folder, so another key's path never resolves."""
        segment = {"training": "weights", "sampler": "sampler_weights"}[kind]
        shape = f"tinker://MODEL_ID/{segment}/NAME"
        try:
            parsed = ParsedCheckpointTinkerPath.from_tinker_path(tinker_path)
        except ValueError:
            raise ApiError(400, f"{tinker_path!r} is not a {shape} path") from None
        name = parsed.checkpoint_id.split("/", 1)[1]
        if parsed.checkpoint_type != kind or not _NAME.match(name):
            raise ApiError(400, f"{tinker_path!r} is not a {shape} path")
        owner = key_hash(key)  # a key's states sit apart from every other key's
        return self.config.state_dir / owner / quote(parsed.training_run_id, safe="") / segment / name

    def sampler(self, key: str, model_path: str | None, base_model: str | None) -> str | None:
        """The sampler a model_path names (404 unless the key's own), or None for the served base model."""
        if model_path is not None:
            owner, sampler_id = self.sampler_paths.get(model_path, (None, None))
            if owner != key:
                raise ApiError(404, f"sampler weights {model_path!r} not found")
            return sampler_id
        if base_model != self.config.model_name:
            raise ApiError(400, f"base_model {base_model!r} is not served here; this server serves "
                                f"{self.config.model_name!r} (or give a model_path or sampling session)")
        return None

    def sampling_session(self, key: str, sampling_session_id: str) -> SamplingSession:
        sampling = self.sampling.get(sampling_session_id)
        if sampling is None or sampling.key != key:
            raise ApiError(404, f"sampling session {sampling_session_id!r} not found")
        return sampling

    def track(self, model: TrainingModel, metrics: dict[str, float]) -> None:
        if self.runs is not None:
            self.runs.log(model.session_id, {f"{model.tag}.{k}": v for k, v in metrics.items()}, model.steps)

    def end_session(self, session_id: str, status: str = "FINISHED") -> None:
        session = self.sessions.pop(session_id, None)
        if session is not None and self.runs is not None:
            self.runs.end(session_id, status)
        for model_id in sorted(session.models) if session else ():
            model = self.models.pop(model_id, None)
            for path in [p for p in self.sampler_paths if p.startswith(f"tinker://{model_id}/")]:
                del self.sampler_paths[path]
            if model is not None:
                self.runner.submit(Job("remove", model.adapter, {"name": model.adapter}, lambda *a: None))

    async def reap(self) -> None:
        """End sessions whose client stopped heartbeating: their adapters free their slots."""
        while True:
            await asyncio.sleep(min(10.0, self.config.session_timeout_s / 2))
            now = time.monotonic()
            for request_id, pending in list(self.futures.items()):  # results nobody fetched for 10 minutes
                if pending.future.done() and now - pending.done_at > FUTURE_TTL_S:
                    del self.futures[request_id]
            for session_id, session in list(self.sessions.items()):
                if now - session.last_seen > self.config.session_timeout_s:
                    logger.info("session %s timed out; releasing %d model(s)", session_id, len(session.models))
                    self.end_session(session_id, "KILLED")


def _parse(model: type, body: dict):
    try:
        return model.model_validate(body)
    except pydantic.ValidationError as exc:
        raise ApiError(400, f"malformed {model.__name__}: {exc.errors()[0]['loc']}: {exc.errors()[0]['msg']}") from None


async def _json(request: Request, limit: int) -> dict:
    body = await _body(request, limit)
    try:
        data = json.loads(body or b"{}")
    except ValueError as exc:
        raise ApiError(400, f"the body is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ApiError(400, "the body must be a JSON object")
    return data


async def _body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"request body of {declared} bytes is over this server's limit of {limit} bytes")
    body = b""
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise ApiError(413, f"request body is over this server's limit of {limit} bytes")
    if request.headers.get("content-encoding") == "zstd":
        try:
            body = zstandard.ZstdDecompressor().decompress(body, max_output_size=limit)
        except zstandard.ZstdError as exc:
            raise ApiError(400, f"the zstd body does not decompress within {limit} bytes: {exc}") from None
    return body


def _unsupported(name: str):
    async def handler(request: Request):
        raise ApiError(400, f"{name} is not supported by this server yet")
    return handler


UNSUPPORTED = ("save_weights_external", "create_custom_loss",
               "copy_weights", "cancel_future", "unload_model", "retrieve_futures")


def create_app(config: ServiceConfig, runner: EngineRunner | None = None) -> FastAPI:
    """The ASGI app; `runner` defaults to the engine in a worker tree of `config.nproc_per_node` processes."""
    runner = runner or EngineRunner(lambda: RemoteEngine(WorkerTree(
        config.model_id, config.max_tenants, config.max_lora_rank, config.max_length, config.mixed_precision,
        config.nproc_per_node, backend=config.backend, tp_size=config.tp_size,
        fsdp=config.fsdp, nnodes=config.nnodes, rdzv_endpoint=config.rdzv_endpoint, rdzv_id=config.rdzv_id)))
    service = Service(config, runner)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        service.loop = asyncio.get_running_loop()
        reaper = asyncio.create_task(service.reap())
        yield
        reaper.cancel()
        await asyncio.to_thread(runner.stop)

    app = FastAPI(title="Twinkle training service (Tinker API)", lifespan=lifespan)
    app.state.service = service
    limit = config.max_request_bytes

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
        return JSONResponse({"detail": exc.detail}, status_code=exc.status_code, headers=exc.headers)

    # ----- no session needed ----------------------------------------------------------------------
    @app.get(f"{API}/healthz")
    async def healthz():
        return {"status": "ok"}

    @app.get(f"{API}/get_server_capabilities")
    async def capabilities():
        return {"supported_models": [{"model_name": config.model_name, "max_context_length": config.max_length,
                                      "trainable": True, "sampleable": True}]}

    @app.post(f"{API}/client/config")
    async def client_config(request: Request):
        service.key(request)
        # Plain API keys, uncompressed serial fwd/bwd chunks (their order is their arrival order), httpx transport.
        return {"pjwt_auth_enabled": False, "parallel_fwdbwd_chunks": False, "proto_compress_fwdbwd": False,
                "use_pyqwest_transport": False, "custom_loss_server_side": False,
                "sample_use_retrieve_futures": False, "sample_join_sampling_session": False}

    @app.post(f"{API}/client/dynamic_config")
    async def client_dynamic_config(request: Request):
        service.key(request)
        return {"sample_cancel_enabled": False}

    @app.post(f"{API}/telemetry")
    async def telemetry(request: Request):
        await _body(request, limit)  # accepted and dropped: this server keeps no client telemetry
        return {"status": "accepted"}

    # ----- sessions -------------------------------------------------------------------------------
    @app.post(f"{API}/create_session")
    async def create_session(request: Request):
        key = service.key(request)
        body = _parse(types.CreateSessionRequest, await _json(request, limit))
        session_id = "s" + secrets.token_hex(8)
        service.sessions[session_id] = Session(key, time.monotonic())
        if service.runs is not None:
            service.runs.start(session_id, key, body.sdk_version, body.user_metadata)
        return {"type": "create_session", "session_id": session_id}

    @app.post(f"{API}/session_heartbeat")
    async def heartbeat(request: Request):
        key = service.key(request)
        body = _parse(types.SessionHeartbeatRequest, await _json(request, limit))
        service.session(key, body.session_id)
        return {"type": "session_heartbeat"}

    @app.post(f"{API}/sessions/{{session_id}}/finish")
    async def finish(session_id: str, request: Request):
        key = service.key(request)
        service.session(key, session_id)
        body = await _json(request, limit)
        reason = (body.get("reason") or {}).get("type") if isinstance(body.get("reason"), dict) else None
        service.end_session(session_id, {"errored": "FAILED", "interrupted": "KILLED"}.get(reason, "FINISHED"))
        return {}

    # ----- training models ------------------------------------------------------------------------
    @app.post(f"{API}/create_model")
    async def create_model(request: Request):
        key = service.key(request)
        body = _parse(types.CreateModelRequest, await _json(request, limit))
        session = service.session(key, body.session_id)
        if body.base_model != config.model_name:
            raise ApiError(400, f"base_model {body.base_model!r} is not served here; this server serves "
                                f"{config.model_name!r}")
        if body.lora_config is None:
            raise ApiError(400, "create_model without lora_config: this server trains LoRA adapters only")
        if body.optimizer_config.type != "adamw":
            raise ApiError(400, f"optimizer {body.optimizer_config.type!r} is not supported by this server (adamw)")
        lora = body.lora_config
        if lora.rank > config.max_lora_rank or lora.rank < 1:
            raise ApiError(400, f"lora rank {lora.rank} is outside 1..{config.max_lora_rank} (--max-lora-rank)")
        model_id = service.new_model(key, session, body.session_id, body.model_seq_id, lora.rank)
        adapter = service.models[model_id].adapter

        args = {"name": adapter, "rank": lora.rank, "seed": lora.seed, "train_attn": lora.train_attn,
                "train_mlp": lora.train_mlp}
        return service.submit(key, "create", adapter, args,
                              service.made(model_id, {"type": "create_model", "model_id": model_id}), model_id)

    @app.post(f"{API}/get_info")
    async def get_info(request: Request):
        key = service.key(request)
        body = _parse(types.GetInfoRequest, await _json(request, limit))
        model = service.model(key, body.model_id)
        return {"type": "get_info", "model_id": body.model_id, "is_lora": True, "lora_rank": model.rank,
                "model_name": config.model_name,
                "model_data": {"model_name": config.model_name, "tokenizer_id": config.tokenizer_id}}

    async def forward_backward(request: Request, forward_only: bool):
        key = service.key(request)
        try:
            parsed = decode_forward_backward(await _body(request, limit), forward_only)
        except WireError as exc:
            raise ApiError(400, str(exc)) from None
        model_id, model = parsed.model_id, service.model(key, parsed.model_id)
        parsed.model_id = model.adapter

        tokens = sum(len(datum.tokens) for datum in parsed.data)
        weight = sum(float(datum.inputs["weights"].sum()) for datum in parsed.data if "weights" in datum.inputs)

        def encoded(result, error):
            if error is not None:
                return None
            if not parsed.forward_only:
                service.track(model, {"loss_sum": result[1]["loss:sum"], "tokens": tokens})
                if parsed.loss_fn == "cross_entropy" and weight > 0:
                    model.last_loss = result[1]["loss:sum"] / weight
            return encode_forward_backward(*result)

        return service.submit(key, FORWARD_BACKWARD, model.adapter, parsed, encoded, model_id)

    @app.post(f"{API}/forward_backward")
    async def forward_backward_route(request: Request):
        return await forward_backward(request, False)

    @app.post(f"{API}/forward")
    async def forward_route(request: Request):
        return await forward_backward(request, True)

    @app.post(f"{API}/optim_step")
    async def optim_step(request: Request):
        key = service.key(request)
        body = _parse(types.OptimStepRequest, await _json(request, limit))
        model = service.model(key, body.model_id)
        params = body.optim_params
        if not isinstance(params, types.AdamParams):
            raise ApiError(400, f"optimizer params of type {getattr(params, 'type', '?')!r}: this server steps AdamW")
        args = {"name": model.adapter, **params.model_dump(include={"learning_rate", "beta1", "beta2", "eps",
                                                                      "weight_decay", "grad_clip_norm"})}
        def stepped(result, error):
            if error is not None:
                return None
            model.steps += 1
            service.track(model, {"grad_norm": result["grad_norm:mean"], "learning_rate": params.learning_rate})
            return {"type": "optim_step", "metrics": result}

        return service.submit(key, "optim_step", model.adapter, args, stepped, body.model_id)

    # ----- training states ----------------------------------------------------------------------------
    @app.post(f"{API}/save_weights")
    async def save_weights(request: Request):
        key = service.key(request)
        body = _parse(types.SaveWeightsRequest, await _json(request, limit))
        model = service.model(key, body.model_id)
        name = body.path if body.path is not None else f"state-{int(time.time())}-{secrets.token_hex(3)}"
        path = f"tinker://{body.model_id}/weights/{name}"
        directory = service.state_dir(key, path)
        if directory.exists() and not body.overwrite:
            raise ApiError(400, f"{path} exists already; save under another name or with overwrite=True")
        return service.submit(key, "save_state", model.adapter, {"name": model.adapter, "directory": str(directory)},
                              lambda result, error: None if error else {"type": "save_weights", "path": path},
                              body.model_id)

    @app.post(f"{API}/load_weights")
    async def load_weights(request: Request):
        key = service.key(request)
        body = _parse(types.LoadWeightsRequest, await _json(request, limit))
        directory = service.state_dir(key, body.path)
        if not (directory / "adapter" / "adapter_config.json").is_file():
            raise ApiError(404, f"training state {body.path!r} not found")
        if body.model_id is not None:  # into an existing training model
            model = service.model(key, body.model_id)
            args = {"name": model.adapter, "directory": str(directory), "optimizer": body.optimizer}
            return service.submit(key, "load_state", model.adapter, args, lambda result, error: None if error else
                                  {"type": "load_weights", "path": body.path, "model_id": body.model_id}, body.model_id)
        if body.session_id is None or body.model_seq_id is None:
            raise ApiError(400, "load_weights needs model_id, or session_id with model_seq_id")
        if body.base_model not in (None, config.model_name):
            raise ApiError(400, f"base_model {body.base_model!r} is not served here ({config.model_name!r})")
        rank = int(json.loads((directory / "adapter" / "adapter_config.json").read_text())["r"])
        if rank > config.max_lora_rank:
            raise ApiError(400, f"the state's lora rank {rank} is over this server's --max-lora-rank {config.max_lora_rank}")
        session = service.session(key, body.session_id)
        model_id = service.new_model(key, session, body.session_id, body.model_seq_id, rank)
        adapter = service.models[model_id].adapter

        args = {"name": adapter, "directory": str(directory), "optimizer": body.optimizer}
        return service.submit(key, "create_from_state", adapter, args, service.made(
            model_id, {"type": "load_weights", "path": body.path, "model_id": model_id}), model_id)

    # ----- sampling ---------------------------------------------------------------------------------
    @app.post(f"{API}/save_weights_for_sampler")
    async def save_weights_for_sampler(request: Request):
        key = service.key(request)
        body = _parse(types.SaveWeightsForSamplerRequest, await _json(request, limit))
        model = service.model(key, body.model_id)
        sampler_id = "w" + secrets.token_hex(8)
        if body.path is not None:
            if not _NAME.match(body.path):
                raise ApiError(400, f"sampler weights name {body.path!r}: use 1-200 letters, digits, '_', '.', '-'")
            path = f"tinker://{body.model_id}/sampler_weights/{body.path}"
            directory = service.state_dir(key, path, "sampler")
            register_as = (body.user_metadata or {}).get(REGISTER_KEY)
            if register_as is not None and (service.runs is None or not config.base_path):
                raise ApiError(400, f"user_metadata {REGISTER_KEY}: this server keeps no MLflow registry (--track)")

            def saved(result, error):
                if error is None:
                    service.sampler_paths[path] = (key, sampler_id)
                    if register_as is not None:
                        base = BaseModelRef(config.model_id, config.base_path, config.base_content_hash)
                        service.runs.register(model.session_id, register_as, str(directory / "adapter"), base,
                                             model.last_loss)
                    return {"type": "save_weights_for_sampler", "path": path}
        else:
            sampling_session_id = "p" + secrets.token_hex(8)

            def saved(result, error):
                if error is None:
                    service.sampling[sampling_session_id] = SamplingSession(key, sampler_id)
                    return {"type": "save_weights_for_sampler", "sampling_session_id": sampling_session_id}
        args = {"name": model.adapter, "sampler_id": sampler_id,
                "directory": str(directory) if body.path is not None else None}
        return service.submit(key, "save_sampler", model.adapter, args, saved, body.model_id)

    @app.post(f"{API}/create_sampling_session")
    async def create_sampling_session(request: Request):
        key = service.key(request)
        body = _parse(types.CreateSamplingSessionRequest, await _json(request, limit))
        service.session(key, body.session_id)
        sampler_id = service.sampler(key, body.model_path, body.base_model)
        sampling_session_id = "p" + secrets.token_hex(8)
        service.sampling[sampling_session_id] = SamplingSession(key, sampler_id)
        return {"type": "create_sampling_session", "sampling_session_id": sampling_session_id}

    @app.get(f"{API}/samplers/{{sampling_session_id}}")
    async def get_sampler(sampling_session_id: str, request: Request):
        key = service.key(request)
        sampling = service.sampling_session(key, sampling_session_id)
        path = next((p for p, (_, s) in service.sampler_paths.items() if s == sampling.sampler_id), None)
        return {"sampler_id": sampling_session_id, "base_model": config.model_name,
                "model_path": path if sampling.sampler_id else None}

    @app.post(f"{API}/join_sampling_session")
    async def join_sampling_session(request: Request):
        key = service.key(request)
        body = _parse(types.JoinSamplingSessionRequest, await _json(request, limit))
        sampling = service.sampling_session(key, body.sampling_session_id)
        sampling.clients += 1
        return {"type": "join_sampling_session", "client_counter": sampling.clients - 1}

    @app.post(f"{API}/asample")
    async def asample(request: Request):
        key = service.key(request)
        body = _parse(types.SampleRequest, await _json(request, limit))
        if body.sampling_session_id is not None:
            sampler_id = service.sampling_session(key, body.sampling_session_id).sampler_id
        else:
            sampler_id = service.sampler(key, body.model_path, body.base_model)
        refused = [name for name, asked in (("prompt_alt_tokens_k", body.prompt_alt_tokens_k),
                                            ("target_prompt_logprobs", body.target_prompt_logprobs is not None))
                   if asked]
        if refused:
            raise ApiError(400, f"{', '.join(refused)}: not supported by this server (sampled, prompt and top-k "
                                "logprobs are)")
        for k, what in ((body.topk_prompt_logprobs, "topk_prompt_logprobs"),
                        (body.topk_sample_logprobs, "topk_sample_logprobs")):
            if not 0 <= k <= MAX_TOPK:
                raise ApiError(400, f"{what}={k}: this server returns 0..{MAX_TOPK} top tokens a position")
        if body.prompt_logprobs_last_n is not None and not body.prompt_logprobs:
            raise ApiError(400, "prompt_logprobs_last_n needs prompt_logprobs=True")
        params = body.sampling_params
        stop = [params.stop] if isinstance(params.stop, str) else params.stop
        stop_strings = [s for s in stop or [] if isinstance(s, str)]
        if stop_strings and len(stop_strings) != len(stop):
            raise ApiError(400, "stop: give strings or token ids, not both")
        if any(not s for s in stop_strings):
            raise ApiError(400, "stop: an empty stop string would stop before the first token")
        if not 1 <= body.num_samples <= 64:
            raise ApiError(400, f"num_samples={body.num_samples}: this server takes 1..64 per request")
        if params.temperature < 0 or not 0 < params.top_p <= 1:
            raise ApiError(400, f"temperature={params.temperature}, top_p={params.top_p}: need temperature >= 0 "
                                "and 0 < top_p <= 1")
        max_tokens = params.max_tokens if params.max_tokens is not None else 64
        if max_tokens < 1:
            raise ApiError(400, f"max_tokens={max_tokens} must be >= 1")
        try:
            prompt = body.prompt.to_ints()
        except ValueError:
            raise ApiError(400, "only token chunks are supported by this server (a text-only base model)") from None
        args = {"sampler_id": sampler_id, "prompt": prompt, "num_samples": body.num_samples, "max_tokens": max_tokens,
                "temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k,
                "seed": params.seed if params.seed is not None else secrets.randbits(31), "stop_tokens": None if stop is None or stop_strings else [int(t) for t in stop],
                "stop_strings": stop_strings or None,
                "prompt_logprobs": bool(body.prompt_logprobs), "topk_prompt": body.topk_prompt_logprobs,
                "topk_sample": body.topk_sample_logprobs, "prompt_last_n": body.prompt_logprobs_last_n}

        def encoded(result, error):
            if error is None:
                return encode_sample(*result)

        future = service.submit(key, "sample", sampler_id or "__base__", args, encoded)
        return {**future, "sample_sequence_ids": [f"{future['request_id']}-{i}" for i in range(body.num_samples)]}

    @app.post(f"{API}/retrieve_future")
    async def retrieve_future(request: Request):
        key = service.key(request)
        body = _parse(types.FutureRetrieveRequest, await _json(request, limit))
        return await service.retrieve(key, body.request_id)

    for name in UNSUPPORTED:
        app.post(f"{API}/{name}", name=f"unsupported_{name}")(_unsupported(name))

    return app
