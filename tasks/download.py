"""download: resolve model and dataset ids to local files (cached across flow runs)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

from prefect import get_run_logger, task
from prefect.cache_policies import TASK_SOURCE, CacheKeyFnPolicy
from prefect.context import TaskRunContext

from tasks.refs import DatasetRef, ModelRef
from twinkle_core.data.pretrain import check_indexed_prefix, indexed_corpus_hash, is_indexed_prefix
from twinkle_core.families import UnsupportedModelError, family_for_model_dir
from twinkle_core.hashing import hash_json
from twinkle_core.hub import HubError, HubUnreachable, check_weight_files, resolve_dataset, resolve_model
from twinkle_core.hub.streaming import open_stream
from twinkle_core.paths import cache_root


def _local_fingerprint(path: Path) -> list:
    """Size and mtime of a local file or of every file in a folder: editing it changes the cache key."""
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    return [(str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in files]


def _fingerprint(local: Path) -> list | None:
    """_local_fingerprint of a local file or folder, or of PREFIX.bin/.idx for a Megatron corpus prefix."""
    if local.suffix in (".bin", ".idx"):  # a Megatron corpus named by one of its files: key both
        local = local.with_suffix("")
    if local.exists():
        return _local_fingerprint(local)
    files = [Path(f"{local}{suffix}") for suffix in (".bin", ".idx")]
    return [entry for p in files if p.is_file() for entry in _local_fingerprint(p)] or None


def _local_source(text: str) -> Path | None:
    """The local file or folder behind a local or pkg:// id (found without importing the package)."""
    if text.startswith("pkg://"):
        package, _, inner = text[len("pkg://"):].partition("/")
        spec = importlib.util.find_spec(package) if package.isidentifier() else None
        locations = list(spec.submodule_search_locations or []) if spec else []
        return Path(locations[0]) / inner if locations else None
    if "://" not in text or text.startswith("file://"):
        return Path(text.removeprefix("file://")).expanduser()
    return None


def _id_cache_key(context: TaskRunContext, parameters: dict) -> str:
    """Remote ids are keyed by the id (the hub pins content by revision); local ones also by their files.
    The id is the first parameter; the others (load options) are part of the key as they are."""
    text, *options = parameters.values()
    local = _local_source(text)
    fingerprint = _fingerprint(local) if local is not None else None
    return hash_json([text, fingerprint, str(cache_root()), options])


def _is_transient(task, task_run, state) -> bool:
    """Retry an unreachable hub, not an id that is wrong (HubError says what to fix)."""
    try:
        state.result()
    except HubUnreachable:
        return True
    except (HubError, UnsupportedModelError):  # the id or the checkpoint needs fixing, not another try
        return False
    except Exception:  # noqa: BLE001 - I/O errors outside the resolver (disk, network) are worth a retry
        return True
    return False


ID_CACHE = TASK_SOURCE + CacheKeyFnPolicy(cache_key_fn=_id_cache_key)
# Cached results are stored as JSON (their pydantic fields), never as pickles: whoever can write Prefect's
# result storage cannot run code in a flow that reads a cache hit. The same holds in tokenize, pack and
# evaluate_preference.


@task(cache_policy=ID_CACHE, persist_result=True, result_serializer="json", retries=2,
      retry_delay_seconds=5, retry_condition_fn=_is_transient)
def download_model(model_id: str, chat_template: str | None = None, trust_remote_code: bool = False,
                   allow_pickle_weights: bool = False) -> ModelRef:
    """Resolve a model id (ms://, hf://, pkg://, local, GGUF) to a Hugging Face directory.

    `chat_template` (Jinja source), `trust_remote_code` and `allow_pickle_weights` travel with the ModelRef to
    every task that opens it.
    """
    resolved = resolve_model(model_id)
    if check_weight_files(resolved.path, model_id, allow_pickle_weights) == "pickle":
        get_run_logger().warning("%s: loading pickle weights (allow_pickle_weights), read with "
                                 "torch.load(weights_only=True)", model_id)
    family = family_for_model_dir(resolved.path, model_id, trust_remote_code)
    log = get_run_logger()
    log.info("%s: %s family, %s", model_id, family.title, resolved.path)
    if not family.tested:
        log.warning("%s: %s", model_id, family.notes)
    if trust_remote_code:
        log.warning("%s: trust_remote_code is on: the checkpoint's own modelling code runs in this run", model_id)
    return ModelRef(model_id=model_id, path=str(resolved.path), content_hash=resolved.content_hash,
                    family=family.name, template_source=chat_template, trust_remote_code=trust_remote_code,
                    allow_pickle_weights=allow_pickle_weights)


@task(cache_policy=ID_CACHE, persist_result=True, result_serializer="json", retries=2,
      retry_delay_seconds=5, retry_condition_fn=_is_transient)
def download_dataset(dataset_id: str, streaming: bool = False) -> DatasetRef:
    """Resolve a dataset id (ms://, hf://, pkg://, local .jsonl/.json/.parquet) to one local file; with
    `streaming`, to a stream the tokenize task reads row by row (a hub split is not copied first)."""
    if streaming:
        stream = open_stream(dataset_id)
        return DatasetRef(dataset_id=dataset_id, path=stream.source, content_hash=stream.content_hash, streaming=True)
    resolved = resolve_dataset(dataset_id)
    return DatasetRef(dataset_id=dataset_id, path=str(resolved.path), content_hash=resolved.content_hash)


def indexed_prefix(dataset_id: str) -> Path | None:
    """The Megatron corpus prefix a local id names (PREFIX, or PREFIX.bin / PREFIX.idx), else None; a prefix
    with only one of its two files is refused here, naming the missing one."""
    local = _local_source(dataset_id)
    if local is None or local.is_dir():
        return None
    prefix = local.with_suffix("") if local.suffix in (".bin", ".idx") else local
    if prefix.is_file() or not any(Path(f"{prefix}{s}").is_file() for s in (".bin", ".idx")):
        return None
    try:
        check_indexed_prefix(prefix)
    except FileNotFoundError as error:
        raise HubError(f"dataset id {dataset_id!r}: {error}") from None
    return prefix


@task(cache_policy=ID_CACHE, persist_result=True, result_serializer="json", retries=2,
      retry_delay_seconds=5, retry_condition_fn=_is_transient)
def download_corpus(dataset_id: str) -> DatasetRef:
    """A pre-training corpus: a Megatron-LM corpus prefix (PREFIX.bin + PREFIX.idx, as --data-path takes it)
    read where it lies, else whatever download_dataset resolves. Only the pretrain flow reads prefixes, so
    download_dataset itself still refuses them (the other flows would fail later, less clearly)."""
    prefix = indexed_prefix(dataset_id)
    if prefix is None:
        return download_dataset.fn(dataset_id)
    return DatasetRef(dataset_id=dataset_id, path=str(prefix.resolve()), content_hash=indexed_corpus_hash(prefix))
