"""Bad input, one row per mistake a user makes, across the flows: each gets its own clear message (one
message, no traceback, exit status 1 or the option parser's), and leaves no run folder and no registered
model version behind.

The first rows are refused while the options are read, before any Prefect server or task starts; the last
ones fail inside the flow run (the data set or the model does not fit), where the terminal shows the
message once and the Prefect log keeps the traceback.
"""
from __future__ import annotations

import importlib
import json
import logging
import time

import pytest
from mlflow import MlflowClient

from tiny_models import save_tiny_model
from twinkle_core.data import DatasetError
from twinkle_core.tracking import tracking_uri

# (id, flow module, options, a part of the message that must appear, verbatim). {ws} is the workspace.
AT_PARSE = [
    ("missing-model-dir", "sft", ["--model-id", "{ws}/no-such-model"],
     "model_id='{ws}/no-such-model': local path does not exist"),
    ("missing-dataset-file", "sft", ["--dataset", "{ws}/no-such.jsonl"],
     "dataset='{ws}/no-such.jsonl': local path does not exist"),
    ("missing-eval-dataset", "sft", ["--eval-dataset", "{ws}/none.jsonl"],
     "eval_dataset='{ws}/none.jsonl': local path does not exist"),
    ("unknown-scheme", "sft", ["--model-id", "xx://org/name"],
     "model_id='xx://org/name': unknown scheme 'xx://' in id 'xx://org/name'; valid forms: ms://org/name[@revision]"),
    ("empty-hub-id", "sft", ["--model-id", "hf://"], "model_id='hf://': repo name '' is not of the form org/name"),
    ("pickle-only-weights", "sft", ["--model-id", "{ws}/pickled"],
     "model id '{ws}/pickled' ships its weights only as pickle files (pytorch_model.bin), which this project does "
     "not load by default; convert them to safetensors, or pass --allow-pickle-weights"),
    ("yaml-syntax", "sft", ["--config", "{ws}/syntax.yaml"],
     "--config {ws}/syntax.yaml, line 3, column 1: not valid YAML: expected ',' or ']', but got '<stream end>'"),
    ("yaml-list", "sft", ["--config", "{ws}/list.yaml"],
     "--config {ws}/list.yaml: the top level is a list, not a mapping of options"),
    ("yaml-not-utf8", "sft", ["--config", "{ws}/latin1.yaml"], "--config {ws}/latin1.yaml: not UTF-8 text (byte 20)"),
    ("yaml-unknown-option", "sft", ["--config", "{ws}/unknown.yaml"],
     "--config {ws}/unknown.yaml: unknown options ['learning_rate']; see --help for the valid ones"),
    ("missing-config", "sft", ["--config", "{ws}/nope.yaml"], "--config {ws}/nope.yaml: no such file"),
    ("precision-typo", "sft", ["--mixed-precision", "bf17"],
     "mixed_precision: Input should be 'auto', 'bf16', 'fp16', 'fp8' or 'no'"),
    ("resume-missing", "sft", ["--resume", "{ws}/runs/nope"], "--resume {ws}/runs/nope: no such run folder"),
    ("resume-other-flow", "dpo", ["--resume", "{ws}/sft-run"],
     "--resume {ws}/sft-run: that folder is a run of the sft flow, not of dpo"),
    ("dpo-missing-dataset", "dpo", ["--dataset", "{ws}/pairs.jsonl"],
     "dataset='{ws}/pairs.jsonl': local path does not exist"),
    ("embedding-missing-model", "embedding", ["--model-id", "{ws}/no-bert"],
     "model_id='{ws}/no-bert': local path does not exist"),
    ("grpo-unknown-reward", "grpo", ["--rewards", '["numeric_match", "no_such_reward"]'],
     "rewards: reward 'no_such_reward': use a built-in (exact_match, numeric_match, format, length_penalty) or "
     "'module:function'"),
    ("grpo-weights-count", "grpo", ["--reward-weights", "[1.0]"],
     "reward_weights=[1.0]: 1 weights for 2 rewards ['numeric_match', 'format']; give one each"),
    ("pretrain-missing-dataset", "pretrain", ["--dataset", "{ws}/corpus.txt"],
     "dataset='{ws}/corpus.txt': local path does not exist"),
    ("multi-lora-missing-model", "multi_lora", ["--model-id", "{ws}/nothing"],
     "model_id='{ws}/nothing': local path does not exist"),
    ("unknown-option", "sft", ["--learning-rate", "1e-4"], "unknown option --learning-rate; did you mean --lr?"),
    ("unknown-option-dpo", "dpo", ["--bta=0.2"], "unknown option --bta; did you mean --beta?"),
    ("dataset-suffix", "sft", ["--dataset", "{ws}/rows.csv"],
     "dataset='{ws}/rows.csv': '{ws}/rows.csv' is not one of .jsonl, .json, .parquet"),
    ("dataset-empty", "sft", ["--eval-dataset", "{ws}/empty.jsonl"],
     "eval_dataset='{ws}/empty.jsonl': '{ws}/empty.jsonl' is empty (0 bytes): it has no rows"),
    ("dataset-folder", "sft", ["--dataset", "{ws}/two_files"],
     "dataset='{ws}/two_files': folder '{ws}/two_files' must hold exactly one .jsonl/.json/.parquet file, "
     "found 2"),
    ("grpo-dataset-empty", "grpo", ["--dataset", "{ws}/empty.jsonl"],
     "dataset='{ws}/empty.jsonl': '{ws}/empty.jsonl' is empty"),
    ("pretrain-dataset-suffix", "pretrain", ["--dataset", "{ws}/corpus.csv"],
     "dataset='{ws}/corpus.csv': '{ws}/corpus.csv' is not one of .jsonl, .json, .parquet"),
    ("truncated-weights", "sft", ["--model-id", "{ws}/truncated"],
     "model id '{ws}/truncated' is damaged: model.safetensors is"),
    ("no-weights", "dpo", ["--model-id", "{ws}/weightless"],
     "model id '{ws}/weightless' is damaged: it has config.json but no weight files"),
    ("no-tokenizer", "grpo", ["--model-id", "{ws}/tokenizerless"],
     "model id '{ws}/tokenizerless' is damaged: no tokenizer files (tokenizer.json"),
]
IN_FLOW = [
    ("no-usable-rows", "sft", ["--dataset", "{ws}/no_messages.jsonl"],
     "sft failed: {ws}/no_messages.jsonl: none of its 2 rows is usable:\n  {ws}/no_messages.jsonl:1: missing 'messages'"),
    ("too-many-bad-rows", "sft", ["--dataset", "{ws}/mostly_bad.jsonl"],
     "sft failed: {ws}/mostly_bad.jsonl: 3 of 4 rows are bad (75.0%), more than max_bad_fraction=0.01"),
    ("json-not-utf8", "sft", ["--dataset", "{ws}/latin1.json"],
     "sft failed: {ws}/latin1.json is not UTF-8 text: byte 0xe9 on line 1; a .json dataset is read whole"),
    ("tp-does-not-divide-heads", "sft", ["--nproc-per-node", "3", "--tp-size", "3"],
     "tp_size=3 must divide num_attention_heads=4 and num_key_value_heads=2; tp_size can be one of [1, 2]."),
    ("media-for-a-text-model", "sft", ["--dataset", "{ws}/with_images.jsonl"],
     "sft failed: {ws}/with_images.jsonl: none of its 2 rows is usable:\n  {ws}/with_images.jsonl:1: the row carries "
     "images, but this run's model reads text only (its media would be dropped); images and videos train on "
     "vision-language families: Qwen 2.5 VL"),
    ("dpo-chat-rows", "dpo", ["--model-id", "{ws}/tiny-llama", "--dataset", "{ws}/train.jsonl"],
     "{ws}/train.jsonl:10: row has keys ['messages']; a preference row needs 'messages' (or 'prompt') with "
     "'chosen' and 'rejected'"),
]


def _inputs(ws) -> None:
    """The bad files the table names, beside the good tiny model and data of the workspace."""
    root = ws["root"]
    pickled = save_tiny_model(root / "pickled", "llama")
    for path in pickled.glob("*.safetensors"):
        path.unlink()
    (pickled / "pytorch_model.bin").write_bytes(b"not read")
    truncated = save_tiny_model(root / "truncated", "llama")
    weights = truncated / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # an interrupted download
    weightless = save_tiny_model(root / "weightless", "llama")
    (weightless / "model.safetensors").unlink()
    tokenizerless = save_tiny_model(root / "tokenizerless", "llama")
    (tokenizerless / "tokenizer.json").unlink()
    (root / "syntax.yaml").write_text("lr: 1e-4\nmax_steps: [3\n")
    (root / "list.yaml").write_text("- lr: 1e-4\n")
    (root / "latin1.yaml").write_bytes("experiment_name: caf\xe9\n".encode("latin-1"))
    (root / "unknown.yaml").write_text("learning_rate: 1e-4\n")
    (root / "sft-run").mkdir()
    (root / "sft-run" / "parameters.json").write_text(json.dumps({"flow": "sft", "parameters": {}}))
    (root / "no_messages.jsonl").write_text('{"foo": 1}\n{"bar": 2}\n')
    good = json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello."}]})
    (root / "mostly_bad.jsonl").write_text(good + '\n{"foo": 1}\n{"foo": 2}\n{"foo": 3}\n')
    (root / "latin1.json").write_bytes(b'[{"messages": "caf\xe9"}]')
    pictured = {"messages": [{"role": "user", "content": [{"type": "image", "image": "cat.png"},
                                                          {"type": "text", "text": "What is it?"}]},
                             {"role": "assistant", "content": "A cat."}]}
    (root / "with_images.jsonl").write_text(json.dumps({**json.loads(good), "images": ["cat.png"]}) + "\n"
                                           + json.dumps(pictured) + "\n")
    (root / "rows.csv").write_text("messages\nhi\n")
    (root / "corpus.csv").write_text("text\nhi\n")
    (root / "empty.jsonl").write_bytes(b"")
    (root / "two_files").mkdir()
    (root / "two_files" / "a.jsonl").write_text(good + "\n")
    (root / "two_files" / "b.jsonl").write_text(good + "\n")


def _run(module: str, argv: list[str], capsys) -> str:
    """The flow's command line; what it told the user (its SystemExit, or what it printed on failure)."""
    try:
        status = importlib.import_module(f"flows.{module}").main(argv)
    except SystemExit as stop:
        return str(stop.code)
    assert status == 1
    return capsys.readouterr().err


@pytest.mark.parametrize("case", AT_PARSE + IN_FLOW, ids=[c[0] for c in AT_PARSE + IN_FLOW])
def test_bad_input_gets_its_message_and_leaves_nothing(sft_workspace, capsys, monkeypatch, case):
    ws = sft_workspace
    # Prefect's terminal handler keeps the stream of the test that first logged; pytest has closed it since
    monkeypatch.setattr(logging, "raiseExceptions", False)
    _inputs(ws)
    name, module, options, expected = case
    fill = lambda text: text.replace("{ws}", str(ws["root"]))
    base = ["--model-id", str(ws["model"]), "--dataset", str(ws["train"]), "--eval-dataset", str(ws["heldout"]),
            "--output-dir", str(ws["root"] / "runs"), "--max-steps", "1"]
    if module in ("embedding", "grpo", "pretrain", "multi_lora", "dpo"):
        base = ["--output-dir", str(ws["root"] / "runs")]
    started = time.monotonic()
    message = _run(module, [fill(o) for o in base + options], capsys)
    seconds = time.monotonic() - started
    assert fill(expected) in message
    if case in AT_PARSE:  # refused while the options are read: no server, no task, no model load
        assert seconds < 15, seconds
    assert "Traceback" not in message
    if case in IN_FLOW:
        assert message.rstrip().endswith("(--debug shows the traceback)")
    runs = ws["root"] / "runs"
    assert not runs.exists() or not any(runs.iterdir()), sorted(runs.rglob("*"))
    assert MlflowClient(tracking_uri()).search_model_versions() == []


def test_debug_shows_the_traceback_of_a_users_error(sft_workspace):
    ws = sft_workspace
    _inputs(ws)
    from flows.sft import main

    with pytest.raises(DatasetError, match="none of its 2 rows is usable"):
        main(["--model-id", str(ws["model"]), "--dataset", str(ws["root"] / "no_messages.jsonl"),
              "--output-dir", str(ws["root"] / "runs"), "--debug"])
    assert not (ws["root"] / "runs").exists()


def test_a_users_error_inside_the_training_workers_is_one_message(sft_workspace, capsys, monkeypatch):
    """A reward function that raises runs in the torchrun workers: its RewardError reaches the command line as
    the same one message (no traceback, exit 1), and the run leaves no folder behind."""
    ws = sft_workspace
    monkeypatch.setattr(logging, "raiseExceptions", False)
    root = ws["root"]
    (root / "failing_rewards.py").write_text("def boom(prompts, completions, **kwargs):\n"
                                          "    raise ValueError('the judge is offline')\n")
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.setenv("PYTHONPATH", str(root))  # the workers import it too
    (root / "prompts.jsonl").write_text("".join(json.dumps({"prompt": f"{i} + 1 =", "solution": str(i + 1)}) + "\n"
                                                for i in range(4)))
    message = _run("grpo", ["--model-id", str(ws["model"]), "--dataset", str(root / "prompts.jsonl"),
                            "--rewards", '["failing_rewards:boom"]', "--max-steps", "1", "--batch-size", "2",
                            "--num-generations", "2", "--max-completion-length", "4", "--mixed-precision", "no",
                            "--output-dir", str(root / "runs")], capsys)
    assert "reward 'failing_rewards:boom' raised" in message and "the judge is offline" in message, message
    assert "Traceback" not in message and message.count("the judge is offline") == 1, message
    assert message.rstrip().endswith("(--debug shows the traceback)")
    runs = root / "runs"
    assert not runs.exists() or not any(runs.iterdir()), sorted(runs.rglob("*"))


def test_a_benchmark_that_fails_in_its_worker_is_one_message_and_keeps_the_trained_run(sft_workspace, capsys,
                                                                                         monkeypatch):
    """The sft flow's benchmark worker runs a task of the user's whose metric code raises: the same one message
    (the harness's error, no traceback, exit 1). The run trained before it, so its folder and checkpoint stay
    for --resume; nothing is registered."""
    ws = sft_workspace
    monkeypatch.setattr(logging, "raiseExceptions", False)
    tasks = ws["root"] / "my_tasks"
    tasks.mkdir()
    (tasks / "rows.jsonl").write_text(json.dumps({"q": "Who are you?", "a": "Twinkle"}) + "\n")
    (tasks / "broken.py").write_text("def score(doc, results):\n    raise ValueError('my metric is broken')\n")
    (tasks / "broken.yaml").write_text(
        f"task: my_broken\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {tasks / 'rows.jsonl'}\n"
        "output_type: loglikelihood\ntest_split: test\ndoc_to_text: '{{q}}'\ndoc_to_target: ' {{a}}'\n"
        "process_results: !function broken.score\n"
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n")
    message = _run("sft", ["--model-id", str(ws["model"]), "--dataset", str(ws["train"]), "--eval-dataset",
                           str(ws["heldout"]), "--output-dir", str(ws["root"] / "runs"), "--max-steps", "1",
                           "--eval-prompts", "0", "--mixed-precision", "no", "--eval-tasks", str(tasks)], capsys)
    assert "sft failed: lm-evaluation-harness failed on my_broken: ValueError: my metric is broken" in message, message
    assert "Traceback" not in message and message.count("sft failed:") == 1, message
    assert message.rstrip().endswith("(--debug shows the traceback)")
    (run,) = (ws["root"] / "runs").iterdir()
    assert (run / "checkpoints").is_dir()
    assert MlflowClient(tracking_uri()).search_model_versions() == []
