"""`python -m flows.chat` streams the champion's answer; `python -m flows.export` writes what engines load."""
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from flows import chat, export
from registered_models import ANSWER, QUESTION, prompt_logits
from twinkle_core.convert.gguf_export import GgufExportError, gguf_problems, write_gguf
from twinkle_core.tracking.chat_model import chat_reply, load_chat_parts, prompt_ids


def test_chat_one_shot_streams_the_champions_answer(store, capsys):
    assert chat.main(["--model", "models:/tiny-chat@champion", "--message", "Who are you?",
                      "--max-new-tokens", "12"]) == 0
    assert capsys.readouterr().out.strip() == ANSWER


def test_chat_names_the_unknown_alias_in_one_message(store, capsys):
    assert chat.main(["--model", "models:/tiny-chat@best", "--message", "hi"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'tiny-chat' has no alias or version 'best'" in err


def test_exports_reload_with_the_registered_logits_and_answer(store, tmp_path):
    reference_model, reference_tokenizer = load_chat_parts(store["root"] / "adapter", store["root"] / "base")
    reference = prompt_logits(reference_model, reference_tokenizer)

    merged_dir = tmp_path / "merged"
    assert export.main(["--model", "models:/tiny-chat@champion", "--to", "hf-merged", "--output", str(merged_dir)]) == 0
    merged = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(merged_dir)
    assert torch.allclose(prompt_logits(merged, tokenizer), reference, atol=1e-4, rtol=0)  # merging reorders fp32 sums
    assert chat_reply(merged, tokenizer, QUESTION, 12) == ANSWER

    gguf_dir = tmp_path / "gguf"
    assert export.main(["--model", "models:/tiny-chat@champion", "--to", "gguf", "--output", str(gguf_dir)]) == 0
    gguf = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file="tiny-chat.gguf", dtype=torch.float32).eval()
    gguf_tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file="tiny-chat.gguf")
    assert prompt_ids(gguf_tokenizer, QUESTION).tolist() == prompt_ids(tokenizer, QUESTION).tolist()
    assert torch.allclose(prompt_logits(gguf, gguf_tokenizer), reference, atol=1e-4, rtol=0)
    assert chat_reply(gguf, gguf_tokenizer, QUESTION, 12) == ANSWER


def test_gguf_refuses_other_architectures_with_the_reason(tmp_path):
    config = AutoConfig.for_model("qwen2", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=64)
    assert "model_type 'qwen2' is not a Llama-family architecture" in gguf_problems(config)[0]
    with pytest.raises(GgufExportError, match="export --to hf-merged"):
        write_gguf(AutoModelForCausalLM.from_config(config), None, tmp_path / "x.gguf")
    assert not (tmp_path / "x.gguf").exists()
