"""The MLflow pyfunc chat model of every registered Twinkle language model.

MLflow logs this file as code: it is copied into each model and executed when the model loads, so it
imports only torch, transformers, peft and mlflow (the model's pip requirements), never twinkle_core; except
a vision-language model's, which ships twinkle_core as code (`media` in its config) to encode images as its
training rows were encoded.

Request (`predict`, or POST /invocations of `mlflow models serve`), one conversation per row:
    {"dataframe_records": [{"messages": [{"role": "user", "content": "Who are you?"}]}],
     "params": {"max_new_tokens": 64, "temperature": 0.0}}
Answer: {"predictions": ["I am Twinkle, ..."]}  (temperature 0 is greedy, so answers repeat exactly)
A vision-language model also takes content lists with base64 images (a request never names a server file):
    {"role": "user", "content": [{"type": "image", "image": "data:image/png;base64,..."},
                                 {"type": "text", "text": "What is this?"}]}

The model's `model` artifact is a Hugging Face directory, or a PEFT adapter whose base the model config
names: `base_uri` (the base logged to MLflow once per content hash) or a hub id (`base_model_id`,
`base_revision`).
"""
from __future__ import annotations

import inspect
import json
import os
import shutil
from pathlib import Path

import mlflow
from mlflow.pyfunc import PythonModel

MODEL_ARTIFACT = "model"
ADAPTER_CONFIG = "adapter_config.json"
# Used only when a tokenizer carries no template of its own (the logging side writes the trained one in).
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def is_adapter(model_dir: str | Path) -> bool:
    return (Path(model_dir) / ADAPTER_CONFIG).is_file()


def _base_cache(content_hash: str) -> Path:
    # The same root as twinkle_core.paths.cache_root (this file cannot import it).
    root = Path(os.environ.get("TWINKLE_CACHE") or Path.home() / ".cache" / "twinkle_flows").expanduser()
    return root / "mlflow-bases" / content_hash


def fetch_base(config: dict) -> str:
    """A local directory holding the adapter's base model (downloaded once per content hash)."""
    uri, model_id = config.get("base_uri"), config.get("base_model_id", "")
    if uri:
        target = _base_cache(config["base_content_hash"])
        if not (target / "config.json").is_file():
            partial = target.with_name(target.name + ".partial")
            shutil.rmtree(partial, ignore_errors=True)
            partial.mkdir(parents=True)
            mlflow.artifacts.download_artifacts(artifact_uri=uri, dst_path=str(partial))
            # download_artifacts puts the folder's files under its last path component
            inner = partial / uri.rstrip("/").rsplit("/", 1)[-1]
            (inner if inner.is_dir() else partial).rename(target)
            shutil.rmtree(partial, ignore_errors=True)
        return str(target)
    scheme, _, repo = model_id.partition("://")
    revision = config.get("base_revision") or None
    if scheme == "hf":
        from huggingface_hub import snapshot_download

        return snapshot_download(repo.split("@")[0], revision=revision)
    if scheme == "ms":
        from modelscope import snapshot_download as ms_snapshot_download

        return ms_snapshot_download(repo.split("@")[0], revision=revision)
    raise ValueError(f"the adapter's base {model_id!r} was neither logged to MLflow nor a hub id (hf://, ms://)")


def load_chat_parts(model_dir: str | Path, base_dir: str | Path | None = None, dtype=None):
    """The model (a PeftModel for an adapter on `base_dir`) and its tokenizer, in eval mode."""
    import torch
    from transformers import AutoTokenizer

    dtype = dtype or torch.float32
    if is_adapter(model_dir):
        from peft import PeftModel

        if base_dir is None:
            raise ValueError(f"{model_dir} is a LoRA adapter: give the directory of its base model")
        base_class = model_class(base_dir, trained_weights=model_dir)
        model = PeftModel.from_pretrained(base_class.from_pretrained(base_dir, dtype=dtype), model_dir)
    else:
        model = model_class(model_dir).from_pretrained(model_dir, dtype=dtype)
    return model.eval(), AutoTokenizer.from_pretrained(model_dir)


def model_class(model_dir: str | Path, trained_weights: str | Path | None = None):
    """AutoModelForCausalLM, or AutoModelForImageTextToText for a vision-language checkpoint that has no causal-LM
    class (Qwen2.5-VL, Qwen3-VL, InternVL: it answers text-only conversations as well).

    A model type with both classes (Qwen 3.5: the text model, or the VL model around it) loads as the class the
    weights were trained on: the VL class names its text layers `...language_model...`. Loading such an adapter
    into the text class would match none of its weights, and PEFT would serve the base unchanged."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.models.auto.modeling_auto import (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
                                                        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)

    model_type = AutoConfig.from_pretrained(model_dir).model_type
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return AutoModelForImageTextToText
    if model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES and any(
            ".language_model." in name for name in weight_names(trained_weights or model_dir)):
        return AutoModelForImageTextToText
    return AutoModelForCausalLM


def weight_names(model_dir: str | Path) -> list[str]:
    """The tensor names of a safetensors checkpoint or adapter, read from the file headers only."""
    from safetensors import safe_open

    names = []
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:
            names += list(handle.keys())
    return names


def prompt_ids(tokenizer, messages: list[dict]):
    """The conversation and the assistant header as a (1, n) tensor, rendered by the chat template."""
    text = tokenizer.apply_chat_template(messages, chat_template=None if tokenizer.chat_template else CHATML,
                                         add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]


def chat_reply(model, tokenizer, messages: list[dict], max_new_tokens: int = 64, temperature: float = 0.0,
               streamer=None, encoder=None) -> str:
    """The assistant's answer to one conversation: greedy at temperature 0, else sampled. A conversation with
    images goes through `encoder` (`media_encoder`), as a vision-language model's training rows did."""
    import torch

    sampling = {"do_sample": True, "temperature": temperature} if temperature > 0 else {"do_sample": False}
    if has_media(messages):
        if encoder is None:
            raise ValueError("this model takes text only: a message holds an image or a video")
        inputs = _media_inputs(model, tokenizer, encoder, messages)
    else:
        ids = prompt_ids(tokenizer, messages)
        inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        base = getattr(model, "get_base_model", lambda: model)()
        if "mm_token_type_ids" in inspect.signature(base.forward).parameters:
            inputs["mm_token_type_ids"] = torch.zeros_like(ids)  # Qwen3-VL / 3.5 VL need it: every token is text
    _check_embedded(model, tokenizer, inputs["input_ids"])
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, streamer=streamer,
                             pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id, **sampling)
    return tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True).strip()


def _check_embedded(model, tokenizer, ids) -> None:
    """A token the tokenizer has but the model has no embedding row for (e.g. the `<video>` an InternVL
    tokenizer names, as transformers' own conversion adds it) is a clear error, not an index error."""
    rows = model.get_input_embeddings().num_embeddings
    beyond = sorted({int(i) for i in ids.reshape(-1).tolist() if i >= rows})
    if beyond:
        names = ", ".join(str(tokenizer.convert_ids_to_tokens(i)) for i in beyond)
        raise ValueError(f"the conversation holds {names}, a token this model has no embedding for "
                         f"(ids {beyond}, the model has {rows})")


def has_media(messages: list[dict]) -> bool:
    return any(isinstance(m.get("content"), list) and any(part.get("type") in ("image", "video")
                                                          for part in m["content"]) for m in messages)


def is_vision_checkpoint(model_dir: str | Path) -> bool:
    """A vision-language checkpoint carries its image processor's settings."""
    return (Path(model_dir) / "preprocessor_config.json").is_file()


def media_encoder(tokenizer, model_dir: str | Path):
    """The vision encoder of a vision-language checkpoint (twinkle_core.data), or None for a text model."""
    if not is_vision_checkpoint(model_dir):
        return None
    from twinkle_core.data import get_row_format

    return get_row_format("vision_chat").load_encoder(tokenizer, Path(model_dir))


def _media_inputs(model, tokenizer, encoder, messages: list[dict]) -> dict:
    from twinkle_core.data import get_row_format
    from twinkle_core.objectives.vision import accepted_inputs

    row_format = get_row_format("vision_chat")
    example = row_format.prompt(encoder, messages)
    batch = accepted_inputs(model, row_format.collate([example], pad_token_id=tokenizer.pad_token_id or 0))
    return {key: value for key, value in batch.items() if key != "labels"}


def _conversations(model_input) -> list[list[dict]]:
    """Rows of `messages` from a DataFrame, a dict of lists, or a list of rows."""
    if hasattr(model_input, "to_dict"):
        model_input = model_input.to_dict(orient="records")
    if isinstance(model_input, dict):
        model_input = [model_input] if isinstance(model_input.get("messages", [None])[0], dict) else [
            {"messages": m} for m in model_input["messages"]]
    conversations = []
    for row in model_input:
        messages = row["messages"] if isinstance(row, dict) else row
        if isinstance(messages, str):
            messages = json.loads(messages)
        conversations.append([{"role": str(m["role"]), "content": _content(m["content"])} for m in messages])
    return conversations


def _content(content):
    """A message's text, or its content list (text, image and video parts) as given."""
    if hasattr(content, "tolist"):  # a column of lists can arrive as numpy arrays
        content = content.tolist()
    if isinstance(content, list):
        return [dict(part) for part in content]
    return str(content)


def _served_media_only_inline(messages: list[dict]) -> None:
    """A request's images and videos are base64 data: a served model never opens a file its caller names."""
    from twinkle_core.data.media import is_base64

    for message in messages:
        for part in message["content"] if isinstance(message["content"], list) else ():
            kind = part.get("type")
            if kind in ("image", "video") and not is_base64(str(part.get(kind, ""))):
                raise ValueError(f"a request's {kind} is base64 data (data:image/png;base64,...), not a path or URL")


class TwinkleChatModel(PythonModel):
    """Answers chat conversations with the registered model (greedy unless `temperature` > 0)."""

    def load_context(self, context):
        config = dict(context.model_config or {})
        model_dir = context.artifacts[MODEL_ARTIFACT]
        base_dir = fetch_base(config) if is_adapter(model_dir) else None
        self.model, self.tokenizer = load_chat_parts(model_dir, base_dir)
        # twinkle_core is in the model's code only where `media` says so (a vision-language model)
        self.encoder = media_encoder(self.tokenizer, base_dir or model_dir) if config.get("media") == "true" else None

    def predict(self, context, model_input, params=None):
        params = params or {}
        max_new_tokens = int(params.get("max_new_tokens", 64))
        temperature = float(params.get("temperature", 0.0))
        conversations = _conversations(model_input)
        for messages in conversations:
            if has_media(messages) and self.encoder is not None:
                _served_media_only_inline(messages)
        return [chat_reply(self.model, self.tokenizer, messages, max_new_tokens, temperature, encoder=self.encoder)
                for messages in conversations]


# MLflow executes this file under a module name of its own ("code_model_<hex>") to get the model object.
if __name__.startswith("code_model_"):
    mlflow.models.set_model(TwinkleChatModel())
