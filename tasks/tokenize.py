"""tokenize: encode a dataset with the model's tokenizer and chat template (cached by content)."""
from __future__ import annotations

from prefect import get_run_logger, task
from prefect.cache_policies import INPUTS, TASK_SOURCE

from tasks.refs import DatasetRef, ModelRef, TokenizedRef
from twinkle_core.data import tokenize_dataset
from twinkle_core.families import get_family
from twinkle_core.hub.streaming import open_stream


# num_proc is not in the key: the encoding does not depend on how many processes ran it.
@task(cache_policy=(INPUTS - "num_proc") + TASK_SOURCE, persist_result=True, result_serializer="json")
def tokenize(dataset: DatasetRef, model: ModelRef, max_length: int, packing: bool = False,
             max_bad_fraction: float = 0.01, enable_thinking: bool = True, kind: str = "chat",
             encode_options: dict | None = None, num_proc: int | None = None) -> TokenizedRef:
    """Tokenise `dataset` for `model` in `num_proc` worker processes (None: the cores); inputs carry content
    hashes, so an edited file re-runs this. `encode_options` go to the row kind's encoder (embedding pairs: the
    query prompt, EOS or not)."""
    source = open_stream(dataset.dataset_id) if dataset.streaming else dataset.path
    result = tokenize_dataset(source, model.path, kind=kind, max_length=max_length, packing=packing,
                              max_bad_fraction=max_bad_fraction, enable_thinking=enable_thinking,
                              chat_template=get_family(model.family).chat_template,
                              chosen_template=model.template_source, trust_remote_code=model.trust_remote_code,
                              encode_options=encode_options, num_proc=num_proc)
    log = get_run_logger()
    log.info("%s: %d rows, %d tokens (%d trained), %d bad rows skipped", dataset.dataset_id, result.num_rows,
             result.num_tokens, result.num_trained_tokens, result.num_bad)
    for bad in result.bad[:10]:
        log.warning("skipped %s", bad)
    for message in result.ignored.warnings(dataset.dataset_id):
        log.warning(message)
    return TokenizedRef(path=str(result.path), content_hash=result.content_hash, num_rows=result.num_rows,
                        num_bad=result.num_bad, num_tokens=result.num_tokens,
                        num_trained_tokens=result.num_trained_tokens)
