"""The MLflow pyfunc chat model of every registered Twinkle language model.

MLflow logs this file as code: it is copied into each model and executed when the model loads, so it
imports only torch, transformers, peft and mlflow (the model's pip requirements), never twinkle_core.

Request (`predict`, or POST /invocations of `mlflow models serve`), one conversation per row:
    {"dataframe_records": [{"messages": [{"role": "user", "content": "Who are you?"}]}],
     "params": {"max_new_tokens": 64, "temperature": 0.0}}
Answer: {"predictions": ["I am Twinkle, ..."]}  (temperature 0 is greedy, so answers repeat exactly)

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
               streamer=None) -> str:
    """The assistant's answer to one conversation: greedy at temperature 0, else sampled."""
    import torch

    ids = prompt_ids(tokenizer, messages)
    sampling = {"do_sample": True, "temperature": temperature} if temperature > 0 else {"do_sample": False}
    if "mm_token_type_ids" in inspect.signature(getattr(model, "get_base_model", lambda: model)().forward).parameters:
        sampling["mm_token_type_ids"] = torch.zeros_like(ids)  # Qwen3-VL / 3.5 VL need it: every token is text
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id, streamer=streamer,
                             **sampling)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()


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
        conversations.append([{"role": str(m["role"]), "content": str(m["content"])} for m in messages])
    return conversations


class TwinkleChatModel(PythonModel):
    """Answers chat conversations with the registered model (greedy unless `temperature` > 0)."""

    def load_context(self, context):
        config = dict(context.model_config or {})
        model_dir = context.artifacts[MODEL_ARTIFACT]
        base_dir = fetch_base(config) if is_adapter(model_dir) else None
        self.model, self.tokenizer = load_chat_parts(model_dir, base_dir)

    def predict(self, context, model_input, params=None):
        params = params or {}
        max_new_tokens = int(params.get("max_new_tokens", 64))
        temperature = float(params.get("temperature", 0.0))
        return [chat_reply(self.model, self.tokenizer, messages, max_new_tokens, temperature)
                for messages in _conversations(model_input)]


# MLflow executes this file under a module name of its own ("code_model_<hex>") to get the model object.
if __name__.startswith("code_model_"):
    mlflow.models.set_model(TwinkleChatModel())
