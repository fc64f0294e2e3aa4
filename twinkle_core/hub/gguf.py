"""Turn a GGUF file into a normal Hugging Face model directory, once per content hash."""
from __future__ import annotations

import logging
from pathlib import Path

from twinkle_core.atomic import atomic_dir
from twinkle_core.hashing import hash_file
from twinkle_core.paths import cache_dir

from .errors import HubError

log = logging.getLogger(__name__)


def materialise_gguf(gguf_path: Path) -> tuple[Path, str]:
    """Return (model directory, sha256 of the GGUF); the directory is written on first use only."""
    digest = hash_file(gguf_path)
    final = cache_dir("models") / f"gguf-{digest[:16]}"
    # atomic_dir renames the folder into place only when complete, so config.json means "done".
    if (final / "config.json").is_file():
        log.debug("reusing materialised %s at %s", gguf_path.name, final)
        return final, digest
    log.info("materialising %s into %s (once; dequantizing the weights)", gguf_path, final)
    with atomic_dir(final) as tmp:
        _convert(gguf_path, tmp)
    log.info("materialised %s", final)
    return final, digest


def _convert(gguf_path: Path, out: Path) -> None:
    """Load tokenizer and model from the GGUF (weights dequantized) and save them as safetensors."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_path.parent), gguf_path.name
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name)
    except (ValueError, KeyError, OSError) as exc:
        raise HubError(f"GGUF file {str(gguf_path)!r} could not be loaded by transformers: {exc}") from exc
    # The weights are plain dequantized tensors now, but transformers still flags the model as
    # GGUF-quantized and refuses to save it; dropping the flags saves a normal checkpoint.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    _check_chat_template(tokenizer.chat_template, out, gguf_path)


def _check_chat_template(expected: str | None, out: Path, gguf_path: Path) -> None:
    """Chat fine-tuning needs the GGUF's chat template; make sure the saved tokenizer kept it."""
    from transformers import AutoTokenizer

    if not expected:
        log.warning("GGUF %s has no chat template; chat-format training will need one", gguf_path.name)
        return
    if AutoTokenizer.from_pretrained(out).chat_template != expected:
        raise HubError(f"the chat template of {str(gguf_path)!r} was lost when saving its tokenizer to {out}")
