"""The training service driven by the official `tinker` SDK (the client nobody here wrote), on a tiny Llama.

Tolerances (fp32): the service against a hand-written PEFT + torch AdamW loop on the same seed, logprobs
within 1e-5 after 3 steps; against TransformersModel's own steps on the same chat rows, per-step losses
within 1e-5 relative; a tenant in a mixed batch against the same request alone, 1e-5 (rows are padded to
another length); 2 worker processes against 1 (replicated, FSDP-sharded, on 2 "machines"; megatron tp=2 and
dp=2 against megatron alone), 1e-5 relative; megatron's log-probabilities against the HF model's, 1e-5; a
resumed state against training on, 1e-5.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from urllib.parse import quote

import numpy as np
import pytest
import torch

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

from twinkle_service.app import ServiceConfig, create_app  # noqa: E402

NAME = "tiny-llama"


def _free_port() -> int:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    return port


def _serve(config: ServiceConfig):
    import uvicorn

    port = _free_port()
    app = create_app(config)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    assert app.state.service.runner.ready.wait(300)
    return server, thread, app, f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def service(tiny_model_dir, tmp_path_factory):
    os.environ["TINKER_TELEMETRY"] = "0"
    config = ServiceConfig(model_id=str(tiny_model_dir), model_name=NAME, tokenizer_id=str(tiny_model_dir),
                           mixed_precision="no", max_tenants=3, max_lora_rank=8, max_length=64,
                           max_request_bytes=1 << 20, state_dir=tmp_path_factory.mktemp("state"),
                           tracking_uri=f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}",
                           base_path=str(tiny_model_dir), base_content_hash="tiny")
    server, thread, app, url = _serve(config)
    yield app, url
    server.should_exit = True
    thread.join(30)


def _client(url: str, key: str):
    return tinker.ServiceClient(base_url=url, api_key=key)


def _datum(tokens: list[int], prompt: int) -> types.Datum:
    """Train on the tokens after the first `prompt` (weights 0 before)."""
    weights = np.array([0.0] * (prompt - 1) + [1.0] * (len(tokens) - prompt), dtype=np.float32)
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": np.array(tokens[1:]), "weights": weights})


ROWS = [[5, 17, 23, 42, 8, 99, 13, 7, 64], [3, 11, 6, 81, 27, 30], [44, 2, 19, 71, 5, 5, 60, 33, 12, 90, 4]]


def _reference_logprobs(model_dir, seed: int, rank: int, steps: int, lr: float) -> list[np.ndarray]:
    """The same training, written by hand: a PEFT adapter on the HF model, the summed weighted NLL, AdamW."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear"))
    model.eval()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), eps=1e-12, weight_decay=0.0)

    def logprobs():
        out = []
        for tokens in ROWS:
            ids = torch.tensor([tokens[:-1]])
            logits = model(input_ids=ids).logits[0].float()
            out.append(torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens[1:])[:, None])[:, 0])
        return out

    for _ in range(steps):
        loss = sum(-(torch.from_numpy(_datum(t, 3).loss_fn_inputs["weights"].to_numpy()) * lp).sum()
                   for t, lp in zip(ROWS, logprobs()))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    with torch.no_grad():
        return [lp.numpy() for lp in logprobs()]


def test_sdk_training_equals_a_hand_written_peft_loop(service, tiny_model_dir):
    app, url = service
    client = _client(url, "tml-alice")
    assert client.get_server_capabilities().supported_models[0].model_name == NAME
    training = client.create_lora_training_client(base_model=NAME, rank=4, seed=7).result()
    assert training.get_info().lora_rank == 4
    assert training.get_tokenizer().vocab_size > 0  # resolved offline from the reported tokenizer id
    data = [_datum(t, 3) for t in ROWS]
    losses = []
    for _ in range(3):
        result = training.forward_backward(data, "cross_entropy").result()
        training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        losses.append(result.metrics["loss:sum"])
        # the reported loss is -sum(weights * logprobs) of the returned logprobs
        expected = -sum(float((d.loss_fn_inputs["weights"].to_numpy() * out["logprobs"].to_numpy()).sum())
                        for d, out in zip(data, result.loss_fn_outputs))
        assert result.metrics["loss:sum"] == pytest.approx(expected, rel=1e-5)
    assert losses[-1] < losses[0]
    after = training.forward(data, "cross_entropy").result()
    reference = _reference_logprobs(tiny_model_dir, seed=7, rank=4, steps=3, lr=1e-2)
    for out, ref in zip(after.loss_fn_outputs, reference):
        np.testing.assert_allclose(out["logprobs"].to_numpy(), ref, atol=1e-5)
    session_id = client.holder.get_session_id()
    client.close("success").result()
    # the session is an MLflow run with every step's loss, finished when the client closed
    from mlflow import MlflowClient

    runs = app.state.service.runs
    runs.flush()
    mlflow = MlflowClient(runs.uri)
    run = mlflow.get_run(runs.run_id(session_id))
    assert run.info.status == "FINISHED" and run.data.tags["twinkle.base_model_id"] == NAME
    assert "tml-alice" not in str(run.data.tags)  # only a hash of the key
    logged = [m.value for m in sorted(mlflow.get_metric_history(run.info.run_id, "train_0.loss_sum"),
                                      key=lambda m: m.step)]
    np.testing.assert_allclose(logged, losses, rtol=1e-6)
    assert [m.step for m in mlflow.get_metric_history(run.info.run_id, "train_0.grad_norm")] == [1, 2, 3]


def test_policy_gradient_losses_follow_tinkers_definitions(service):
    app, url = service
    client = _client(url, "tml-carol")
    training = client.create_lora_training_client(base_model=NAME, rank=2, seed=1).result()
    tokens = ROWS[0]
    n = len(tokens) - 1
    sampling = np.linspace(-6.0, -3.0, n).astype(np.float32)
    advantages = np.linspace(-1.0, 1.0, n).astype(np.float32)
    datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={"target_tokens": np.array(tokens[1:]), "logprobs": sampling,
                                        "advantages": advantages})
    out = training.forward([datum], "importance_sampling").result()
    logprobs = out.loss_fn_outputs[0]["logprobs"].to_numpy().astype(np.float64)
    ratio = np.exp(logprobs - sampling)
    assert out.metrics["loss:sum"] == pytest.approx(-(ratio * advantages).sum(), rel=1e-5)
    clip = {"clip_low_threshold": 0.9, "clip_high_threshold": 1.05}
    out = training.forward([datum], "ppo", clip).result()
    clipped = np.clip(ratio, 0.9, 1.05)
    assert out.metrics["loss:sum"] == pytest.approx(-np.minimum(ratio * advantages, clipped * advantages).sum(),
                                                    rel=1e-5)
    client.close("success").result()


def test_tenants_waiting_together_share_one_pass_and_get_their_own_results(service):
    app, url = service
    runner = app.state.service.runner
    alice, bob = _client(url, "tml-alice2"), _client(url, "tml-bob2")
    ta = alice.create_lora_training_client(base_model=NAME, rank=4, seed=11).result()
    tb = bob.create_lora_training_client(base_model=NAME, rank=8, seed=22).result()
    da, db = [_datum(ROWS[0], 2), _datum(ROWS[1], 2)], [_datum(ROWS[2], 4)]
    alone_a = ta.forward(da, "cross_entropy").result()
    alone_b = tb.forward(db, "cross_entropy").result()
    passes = runner.passes
    with runner.held():  # both requests wait, as under load
        fa, fb = ta.forward_backward(da, "cross_entropy"), tb.forward_backward(db, "cross_entropy")
        while runner.waiting() < 2:
            time.sleep(0.01)
    ra, rb = fa.result(), fb.result()
    assert runner.passes == passes + 1
    for mixed, alone in ((ra, alone_a), (rb, alone_b)):
        assert mixed.metrics["loss:sum"] == pytest.approx(alone.metrics["loss:sum"], rel=1e-5)
        for m, a in zip(mixed.loss_fn_outputs, alone.loss_fn_outputs):
            np.testing.assert_allclose(m["logprobs"].to_numpy(), a["logprobs"].to_numpy(), atol=1e-5)
    alice.close("success").result()
    bob.close("success").result()


def test_a_key_sees_only_its_own_models(service):
    from tinker.lib.public_interfaces.training_client import TrainingClient, fetch_training_info

    app, url = service
    alice, mallory = _client(url, "tml-alice3"), _client(url, "tml-mallory")
    training = alice.create_lora_training_client(base_model=NAME, rank=2).result()
    # mallory's SDK client pointed at alice's model id: every call is refused as if it did not exist
    with pytest.raises(tinker.NotFoundError, match="not found"):
        mallory.holder.run_coroutine_threadsafe(fetch_training_info(mallory.holder, training.model_id)).result()
    stolen = TrainingClient(mallory.holder, model_seq_id=0, model_id=training.model_id, info=None)
    with pytest.raises(Exception, match="not found"):
        stolen.forward([_datum(ROWS[0], 2)], "cross_entropy").result()
    assert training.forward([_datum(ROWS[0], 2)], "cross_entropy").result().loss_fn_outputs  # alice's still works
    alice.close("success").result()
    mallory.close("success").result()


@pytest.mark.parametrize("case, message", [
    ("token", "outside the vocabulary"),
    ("shape", "weights has shape"),
    ("length", "input tokens; this server takes 1..64"),
    ("loss", "not supported by this server"),
])
def test_bad_requests_get_a_message_and_the_server_keeps_serving(service, case, message):
    app, url = service
    client = _client(url, "tml-dave")
    training = client.create_lora_training_client(base_model=NAME, rank=2).result()
    tokens, loss_fn = list(ROWS[0]), "cross_entropy"
    datum = _datum(tokens, 2)
    if case == "token":
        datum = _datum(tokens[:-1] + [10 ** 6], 2)
    elif case == "shape":
        datum = types.Datum(model_input=datum.model_input,
                            loss_fn_inputs={**datum.loss_fn_inputs, "weights": np.ones(3, np.float32)})
    elif case == "length":
        datum = _datum(list(range(2, 80)), 2)
    else:
        loss_fn = "dro"
    with pytest.raises(Exception, match=message):
        training.forward_backward([datum], loss_fn).result()
    # the same server, another client, still trains
    fresh = client.create_lora_training_client(base_model=NAME, rank=2).result()
    assert np.isfinite(fresh.forward_backward([_datum(ROWS[1], 2)], "cross_entropy").result().metrics["loss:sum"])
    client.close("success").result()


def test_limits_on_rank_and_tenants(service):
    app, url = service
    client = _client(url, "tml-erin")
    with pytest.raises(tinker.BadRequestError, match="outside 1..8"):
        client.create_lora_training_client(base_model=NAME, rank=16).result()
    with pytest.raises(tinker.BadRequestError, match="is not served here"):
        client.create_lora_training_client(base_model="Qwen/Qwen3-8B", rank=2).result()
    held = [client.create_lora_training_client(base_model=NAME, rank=2).result()
            for _ in range(3 - len(app.state.service.models))]
    with pytest.raises(tinker.BadRequestError, match="max-tenants=3"):
        client.create_lora_training_client(base_model=NAME, rank=2).result()
    client.close("success").result()  # ends the session: its models free their slots
    assert held and not app.state.service.models
    again = _client(url, "tml-erin")
    assert len([again.create_lora_training_client(base_model=NAME, rank=2).result() for _ in range(3)]) == 3
    again.close("success").result()


def test_two_worker_processes_equal_one_replicated_or_sharded(tiny_model_dir, service, tmp_path):
    """2 workers holding the model whole (rows shared out), 2 holding half of every weight (--fsdp: the
    adapters in pre-allocated rank-8 slots, a rank-4 tenant masked), and 2 machines of one sharded worker
    each (machine 1 joins with --node-rank 1), train as 1 does: a pass with a row for
    each worker and one with a single row (the other worker runs a zeroed copy), a state saved and resumed
    with its optimizer, a greedy sample (1e-5)."""
    _, url_one = service
    urls, servers = {"one": url_one}, []
    port = _free_port()
    # "machines": 2 machines of 1 worker each (here both on this one), FSDP across them; machine 1 only joins
    joiner = subprocess.Popen([sys.executable, "-m", "flows.service", "--model-id", str(tiny_model_dir), "--precision",
                               "no", "--max-length", "64", "--max-tenants", "3", "--max-lora-rank", "8", "--fsdp", "true",
                               "--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", f"127.0.0.1:{port}",
                               "--track", "false"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    layouts = {"replicated": dict(nproc_per_node=2), "fsdp": dict(nproc_per_node=2, fsdp=True),
               "machines": dict(fsdp=True, nnodes=2, rdzv_endpoint=f"127.0.0.1:{port}")}
    for layout, parallel in layouts.items():
        config = ServiceConfig(model_id=str(tiny_model_dir), model_name=NAME, tokenizer_id=str(tiny_model_dir),
                               mixed_precision="no", max_length=64, max_tenants=3, max_lora_rank=8,
                               state_dir=tmp_path / layout, **parallel)
        server, thread, _, urls[layout] = _serve(config)
        servers.append((server, thread))
    try:
        results = {}
        for layout, url in urls.items():
            client = _client(url, "tml-frank")
            training = client.create_lora_training_client(base_model=NAME, rank=4, seed=5).result()
            data = [_datum(t, 2) for t in ROWS]  # 3 rows: 2 on rank 0, 1 on rank 1
            losses = []
            for batch in (data, data, data[:1]):
                losses.append(training.forward_backward(batch, "cross_entropy").result().metrics["loss:sum"])
                training.optim_step(types.AdamParams(learning_rate=1e-2, weight_decay=0.1)).result()
            path = training.save_state(f"mid-{layout}").result().path
            resumed = client.create_training_client_from_state_with_optimizer(path).result()
            for trainer in (training, resumed):  # the same step on the saved state and on the one trained on
                losses.append(trainer.forward_backward(data, "cross_entropy").result().metrics["loss:sum"])
                trainer.optim_step(types.AdamParams(learning_rate=1e-2)).result()
            sampler = resumed.save_weights_and_get_sampling_client().result()
            greedy = sampler.sample(types.ModelInput.from_ints([5, 6, 7, 8]), 1,
                                    types.SamplingParams(max_tokens=4, temperature=0.0, stop=[])).result()
            results[layout] = (losses, resumed.forward(data, "cross_entropy").result(), greedy.sequences[0])
            client.close("success").result()
        one_losses, one, one_sample = results["one"]
        assert one_losses[3] == pytest.approx(one_losses[4], rel=1e-6) and one_losses[2] < one_losses[0]
        for layout in layouts:
            losses, two, sample = results[layout]
            np.testing.assert_allclose(losses, one_losses, rtol=1e-5)
            for a, b in zip(one.loss_fn_outputs, two.loss_fn_outputs):
                np.testing.assert_allclose(b["logprobs"].to_numpy(), a["logprobs"].to_numpy(), rtol=1e-5, atol=1e-5)
            assert sample.tokens == one_sample.tokens
            np.testing.assert_allclose(sample.logprobs, one_sample.logprobs, atol=1e-5)
    finally:
        for server, thread in servers:
            server.should_exit = True
            thread.join(60)
        assert joiner.wait(60) == 0  # machine 1's workers end with the server


def test_sampling_is_greedy_exact_a_snapshot_and_scores_like_forward(service, tiny_model_dir, monkeypatch):
    app, url = service
    client = _client(url, "tml-grace")
    training = client.create_lora_training_client(base_model=NAME, rank=8, seed=3).result()
    prompt, vocab = [5, 6, 7, 8], training.get_tokenizer().vocab_size
    greedy = types.SamplingParams(max_tokens=3, temperature=0.0, stop=[])

    def every_logprob(tokens):  # each position's log-probability of every vocabulary token (targets [N, vocab])
        datum = types.Datum(model_input=types.ModelInput.from_ints(tokens),
                            loss_fn_inputs={"target_tokens": np.tile(np.arange(vocab), (len(tokens), 1)),
                                            "weights": np.zeros((len(tokens), vocab), np.float32)})
        return training.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()

    before = training.save_weights_and_get_sampling_client().result()  # the untrained weights, kept as they are
    first = before.sample(types.ModelInput.from_ints(prompt), 1, greedy).result().sequences[0]
    untrained = every_logprob(prompt + first.tokens[:-1])
    for _ in range(8):
        training.forward_backward([_datum(prompt + [9, 10, 11], len(prompt))], "cross_entropy")
        training.optim_step(types.AdamParams(learning_rate=2e-2))
    path = training.save_weights_for_sampler("trained", user_metadata={"twinkle.register": "tiny-service"}).result().path
    assert path.startswith("tinker://") and path.endswith("/sampler_weights/trained")
    trained = client.create_sampling_client(model_path=path).result()
    out = trained.sample(types.ModelInput.from_ints(prompt), 1, greedy, include_prompt_logprobs=True).result()
    tokens = out.sequences[0].tokens
    assert len(tokens) == 3 and out.sequences[0].stop_reason == "length"
    table = every_logprob(prompt + tokens[:-1])
    assert tokens == [int(table[len(prompt) - 1 + i].argmax()) for i in range(3)]  # greedy is the argmax
    assert out.prompt_logprobs[0] is None
    np.testing.assert_allclose(out.prompt_logprobs[1:], [table[i, prompt[i + 1]] for i in range(3)], atol=1e-5)
    # top-k logprobs (most likely first) at the prompt's last 2 positions and at each sampled token
    top = trained.sample(types.ModelInput.from_ints(prompt), 1, greedy, include_prompt_logprobs=True,
                         topk_prompt_logprobs=3, topk_sample_logprobs=2, prompt_logprobs_last_n=2).result()
    assert top.prompt_logprobs[:2] == [None, None] and top.topk_prompt_logprobs[:2] == [None, None]
    np.testing.assert_allclose(top.prompt_logprobs[2:], [table[i, prompt[i + 1]] for i in (1, 2)], atol=1e-5)
    for i, entry in zip((1, 2), top.topk_prompt_logprobs[2:]):
        best = np.argsort(-table[i])[:3]
        assert [t for t, _ in entry] == best.tolist()
        np.testing.assert_allclose([lp for _, lp in entry], table[i, best], atol=1e-5)
    assert top.sequences[0].tokens == tokens and len(top.sequences[0].topk_logprobs) == 3
    for j, entry in enumerate(top.sequences[0].topk_logprobs):
        best = np.argsort(-table[len(prompt) - 1 + j])[:2]
        assert [t for t, _ in entry] == best.tolist() and entry[0][0] == tokens[j]  # greedy took the first
    with pytest.raises(tinker.BadRequestError, match="topk_prompt_logprobs=21: this server returns 0..20"):
        trained.sample(types.ModelInput.from_ints(prompt), 1, greedy, topk_prompt_logprobs=21).result()
    # the snapshot taken before training still samples the untrained weights
    again = before.sample(types.ModelInput.from_ints(prompt), 1, greedy).result().sequences[0]
    assert again.tokens == first.tokens
    np.testing.assert_allclose(again.logprobs, [untrained[len(prompt) - 1 + i, t] for i, t in enumerate(first.tokens)],
                               atol=1e-5)
    assert np.abs(table - untrained).max() > 1e-3  # and training did change the weights
    # sampled logprobs are the sampled weights' own (temperature 1), as forward computes them; stop tokens stop
    sampled = trained.sample(types.ModelInput.from_ints(prompt), 4,
                             types.SamplingParams(max_tokens=5, temperature=1.0, seed=4, stop=[10])).result()
    for sequence in sampled.sequences:
        assert len(sequence.tokens) == len(sequence.logprobs) <= 5
        assert sequence.stop_reason == ("stop" if sequence.tokens[-1] == 10 else "length")
        scored = training.forward([_datum(prompt + sequence.tokens, 1)], "cross_entropy").result()
        np.testing.assert_allclose(sequence.logprobs, scored.loss_fn_outputs[0]["logprobs"].to_numpy()[len(prompt) - 1:],
                                   atol=1e-5)
    # a stop string ends a completion with the token that completes it in the text, its logprobs cut alike
    whole = trained.sample(types.ModelInput.from_ints(prompt), 1, types.SamplingParams(
        max_tokens=5, temperature=0.0, stop=[])).result().sequences[0]
    decode = training.get_tokenizer().decode
    texts = [decode(whole.tokens[:k]) for k in range(len(whole.tokens) + 1)]
    k = next(k for k in range(1, len(texts)) if texts[k] and texts[k] != texts[k - 1])
    stopped = trained.sample(types.ModelInput.from_ints(prompt), 1, types.SamplingParams(
        max_tokens=5, temperature=0.0, stop=texts[k])).result().sequences[0]
    assert stopped.tokens == whole.tokens[:k] and stopped.stop_reason == "stop"
    np.testing.assert_allclose(stopped.logprobs, whole.logprobs[:k], atol=1e-6)
    # registered as the flows register a model: the adapter on its base, answering through pyfunc like the sampler
    import mlflow

    app.state.service.runs.flush(120)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", app.state.service.runs.uri)  # for this test only (not set_tracking_uri:
    # that would pin this process's later tests to the service's store)
    version = mlflow.MlflowClient().get_model_version_by_alias("tiny-service", "champion")
    assert version.tags["twinkle.kind"] == "adapter" and version.tags["twinkle.base_model_id"] == str(tiny_model_dir)
    served = mlflow.pyfunc.load_model("models:/tiny-service@champion")
    assert isinstance(served.predict({"messages": [{"role": "user", "content": "hi"}]},
                                     params={"max_new_tokens": 3})[0], str)
    # another key cannot sample these weights
    other = _client(url, "tml-heidi")
    with pytest.raises(tinker.NotFoundError, match="not found"):
        other.create_sampling_client(model_path=path).result()
    other.close("success").result()
    client.close("success").result()


def test_saved_states_resume_exactly_with_their_optimizer_and_stay_the_keys_own(service):
    app, url = service
    client = _client(url, "tml-ivan")
    training = client.create_lora_training_client(base_model=NAME, rank=4, seed=9).result()
    data = [_datum(t, 2) for t in ROWS]

    def step(trainer):
        trainer.forward_backward(data, "cross_entropy")
        trainer.optim_step(types.AdamParams(learning_rate=1e-2))

    def logprobs(trainer):
        return [o["logprobs"].to_numpy() for o in trainer.forward(data, "cross_entropy").result().loss_fn_outputs]

    for _ in range(2):
        step(training)
    path = training.save_state("ckpt").result().path
    assert path == f"tinker://{training.model_id}/weights/ckpt"
    at_save = logprobs(training)
    for _ in range(2):
        step(training)
    continued = logprobs(training)
    # a new training model from the state, with its AdamW moments: the same two steps give the same weights
    resumed = client.create_training_client_from_state_with_optimizer(path).result()
    assert resumed.get_info().lora_rank == 4
    for got, want in zip(logprobs(resumed), at_save):
        np.testing.assert_allclose(got, want, atol=1e-6)
    for _ in range(2):
        step(resumed)
    for got, want in zip(logprobs(resumed), continued):
        np.testing.assert_allclose(got, want, atol=1e-5)
    # weights only, into the first model: back to the saved weights
    training.load_state(path).result()
    for got, want in zip(logprobs(training), at_save):
        np.testing.assert_allclose(got, want, atol=1e-6)
    with pytest.raises(Exception, match="exists already"):
        training.save_state("ckpt").result()
    other = _client(url, "tml-judy")
    with pytest.raises(tinker.NotFoundError, match="not found"):
        other.create_training_client_from_state(path).result()
    other.close("success").result()
    client.close("success").result()


def _chat_datums(tokenizer, rows) -> list[types.Datum]:
    """cookbook-style supervised datums from the project's chat rows: assistant-only weights."""
    from twinkle_core.data import encode_chat

    datums = []
    for row in rows:
        example = encode_chat(tokenizer, row["messages"])
        ids, labels = list(example["input_ids"]), list(example["labels"])
        weights = np.array([float(label != -100) for label in labels[1:]], dtype=np.float32)
        datums.append(types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                                  loss_fn_inputs={"target_tokens": np.array(ids[1:]), "weights": weights}))
    return datums


def test_a_supervised_loop_equals_transformers_model_step_for_step(service, tiny_model_dir):
    """tinker-cookbook's sl_loop shape on the project's chat rows; the same steps on TransformersModel."""
    from peft import LoraConfig

    from tiny_models import SAMPLE_ROWS
    from twinkle_core.models import TransformersModel

    app, url = service
    client = _client(url, "tml-kim")
    training = client.create_lora_training_client(base_model=NAME, rank=4, seed=13).result()
    data = _chat_datums(training.get_tokenizer(), SAMPLE_ROWS)
    trained = sum(float(d.loss_fn_inputs["weights"].to_numpy().sum()) for d in data)
    served = []
    for _ in range(4):
        result = training.forward_backward(data, "cross_entropy").result()
        training.optim_step(types.AdamParams(learning_rate=1e-2, beta1=0.9, beta2=0.95, eps=1e-12)).result()
        served.append(result.metrics["loss:sum"] / trained)  # Tinker sums; TransformersModel means
    local = TransformersModel(str(tiny_model_dir), mixed_precision="no")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(13)
        local.add_adapter_to_model("default", LoraConfig(r=4, lora_alpha=32, lora_dropout=0.0))
    local.set_optimizer("AdamW", lr=1e-2, betas=(0.9, 0.95), eps=1e-12, weight_decay=0.0)
    reference = []
    for _ in range(4):
        reference.append(local.forward_backward(inputs=SAMPLE_ROWS))
        local.clip_grad_and_step(max_grad_norm=None)
    assert served[-1] < served[0]
    np.testing.assert_allclose(served, reference, rtol=1e-5)
    client.close("success").result()


def test_an_rl_loop_raises_the_mean_reward(service):
    """tinker-cookbook's rl_loop shape: sample a group per prompt, reward, group-relative advantages,
    importance_sampling. Toy reward: the share of even token ids in the completion (about 0.5 by chance)."""
    app, url = service
    client = _client(url, "tml-lee")
    training = client.create_lora_training_client(base_model=NAME, rank=8, seed=17).result()
    prompts, group, length = [[5, 6, 7, 8], [40, 41, 42]], 8, 6
    rewards = []
    for iteration in range(10):
        sampler = training.save_weights_and_get_sampling_client().result()
        futures = [sampler.sample(types.ModelInput.from_ints(p), group, types.SamplingParams(
            max_tokens=length, temperature=1.0, stop=[], seed=100 * iteration + i)) for i, p in enumerate(prompts)]
        data, batch_rewards = [], []
        for prompt, future in zip(prompts, futures):
            sequences = future.result().sequences
            scores = np.array([np.mean([t % 2 == 0 for t in s.tokens]) for s in sequences])
            batch_rewards.extend(scores)
            for sequence, advantage in zip(sequences, scores - scores.mean()):
                tokens, n_prompt = prompt + sequence.tokens, len(prompt) - 1
                data.append(types.Datum(
                    model_input=types.ModelInput.from_ints(tokens[:-1]),
                    loss_fn_inputs={
                        "target_tokens": np.array(tokens[1:]),
                        "logprobs": np.array([0.0] * n_prompt + sequence.logprobs, dtype=np.float32),
                        "advantages": np.array([0.0] * n_prompt + [advantage] * len(sequence.tokens), dtype=np.float32)}))
        rewards.append(float(np.mean(batch_rewards)))
        training.forward_backward(data, "importance_sampling")
        training.optim_step(types.AdamParams(learning_rate=3e-2)).result()
    assert np.mean(rewards[-3:]) > np.mean(rewards[:3]) + 0.06, rewards
    client.close("success").result()


def test_a_state_saved_before_a_restart_trains_on_after_it(service, tiny_model_dir):
    app, url = service
    client = _client(url, "tml-mike")
    training = client.create_lora_training_client(base_model=NAME, rank=4, seed=21).result()
    data = [_datum(t, 2) for t in ROWS]

    def losses(trainer, steps):
        out = []
        for _ in range(steps):
            out.append(trainer.forward_backward(data, "cross_entropy").result().metrics["loss:sum"])
            trainer.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        return out

    losses(training, 2)
    path = training.save_state("before-restart").result().path
    continued = losses(training, 3)
    client.close("success").result()
    state_dir = app.state.service.config.state_dir
    # A new server process tree on the same --state-dir: nothing of the first one is in memory.
    config = ServiceConfig(model_id=str(tiny_model_dir), model_name=NAME, tokenizer_id=str(tiny_model_dir),
                           mixed_precision="no", max_length=64, state_dir=state_dir)
    server, thread, _, url_two = _serve(config)
    try:
        again = _client(url_two, "tml-mike")
        resumed = again.create_training_client_from_state_with_optimizer(path).result()
        np.testing.assert_allclose(losses(resumed, 3), continued, rtol=1e-5)
        # a damaged state is refused with the file named, not loaded
        folder = next(state_dir.rglob("before-restart"))
        (folder / "optimizer.pt").write_bytes(b"truncated")
        with pytest.raises(Exception, match="damaged.*optimizer.pt"):
            again.create_training_client_from_state_with_optimizer(path).result()
        again.close("success").result()
    finally:
        server.should_exit = True
        thread.join(60)


def test_bad_request_table_while_another_client_trains(service):
    """Requests the SDK would never send (malformed, oversized, unauthenticated) get their 4xx and message,
    sent as raw HTTP; a client training meanwhile through the SDK is not disturbed."""
    import httpx

    app, url = service
    worker = _client(url, "tml-nina")
    trainer = worker.create_lora_training_client(base_model=NAME, rank=2, seed=1).result()
    done, errors = [], []

    def train():
        try:
            for _ in range(6):
                trainer.forward_backward([_datum(ROWS[1], 2)], "cross_entropy").result()
                trainer.optim_step(types.AdamParams(learning_rate=1e-3)).result()
                done.append(1)
        except Exception as exc:  # noqa: BLE001 - reported by the assertion below
            errors.append(exc)

    thread = threading.Thread(target=train)
    thread.start()
    key = {"X-API-Key": "tml-oscar"}
    session = httpx.post(f"{url}/api/v1/create_session", headers=key,
                         json={"tags": [], "user_metadata": None, "sdk_version": "0"}).json()["session_id"]
    cases = [
        ("no key", "post", "create_session", {}, {"tags": []}, 401, "API key"),
        ("not JSON", "post", "create_session", key, b"{oops", 400, "not JSON"),
        ("missing field", "post", "create_model", key, {"session_id": session}, 400, "malformed CreateModelRequest"),
        ("unknown session", "post", "create_model", key,
         {"session_id": "s0", "model_seq_id": 0, "base_model": NAME, "lora_config": {"rank": 2}}, 404, "not found"),
        ("not protobuf", "post", "forward_backward", key, b"\xff\xfe not a protobuf", 400, "not a ForwardBackwardRequest"),
        ("too large", "post", "forward_backward", key, b"x" * (2 << 20), 413, "over this server's limit"),
        ("unknown future", "post", "retrieve_future", key, {"request_id": "nope"}, 404, "not found"),
        ("not supported", "post", "save_weights_external", key, {}, 400, "not supported by this server"),
    ]
    for name, method, path, headers, body, status, message in cases:
        content = body if isinstance(body, bytes) else None
        response = httpx.request(method, f"{url}/api/v1/{path}", headers=headers, content=content,
                                 json=None if content is not None else body, timeout=30)
        assert response.status_code == status, (name, response.text)
        assert message in response.json()["detail"], (name, response.text)
        assert response.headers.get("x-should-retry") == "false", name
    thread.join(120)
    assert not errors and len(done) == 6
    worker.close("success").result()


def test_clients_in_parallel_threads_share_passes_and_each_trains_as_alone(service):
    app, url = service
    runner = app.state.service.runner
    seeds, rounds = {"tml-p1": 31, "tml-p2": 32, "tml-p3": 33}, 3
    rows = {"tml-p1": [ROWS[0]], "tml-p2": [ROWS[1], ROWS[2]], "tml-p3": [ROWS[2]]}

    def run(key, trainer, barrier=None):
        data, losses = [_datum(t, 2) for t in rows[key]], []
        for _ in range(rounds):
            if barrier is not None:
                barrier.wait()  # the last round's steps are done
                barrier.wait()  # the main thread holds the runner now
            future = trainer.forward_backward(data, "cross_entropy")
            if barrier is not None:
                barrier.wait()  # every thread has submitted: the main thread lets the runner go
            losses.append(future.result().metrics["loss:sum"])
            trainer.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        return losses

    clients = {key: _client(url, key) for key in seeds}
    alone = {key: run(key, clients[key].create_lora_training_client(base_model=NAME, rank=4, seed=seed).result())
             for key, seed in seeds.items()}
    for client in clients.values():
        client.close("success").result()
    clients = {key: _client(url, key) for key in seeds}
    trainers = {key: clients[key].create_lora_training_client(base_model=NAME, rank=4, seed=seed).result()
                for key, seed in seeds.items()}
    barrier, together = threading.Barrier(len(seeds) + 1, timeout=120), {}
    threads = [threading.Thread(target=lambda k=key: together.__setitem__(k, run(k, trainers[k], barrier)))
               for key in seeds]
    passes = runner.passes
    for thread in threads:
        thread.start()
    for _ in range(rounds):
        barrier.wait()
        with runner.held():
            barrier.wait()  # the threads submit
            barrier.wait()
            while runner.waiting() < len(seeds):
                time.sleep(0.01)
    for thread in threads:
        thread.join(120)
    assert runner.passes - passes == rounds  # 9 requests in 3 shared passes
    for key in seeds:
        np.testing.assert_allclose(together[key], alone[key], rtol=1e-5)
    for client in clients.values():
        client.close("success").result()


def test_mixed_tenant_passes_are_padding_free_and_equal_padded_ones(tiny_model_dir):
    """The engine lays a mixed-tenant pass's rows end to end in one row (each tenant's tokens one span of the
    router's token axis, no padding; a prefix a tenant's rows share held once); its log-probabilities, losses and
    each tenant's gradients equal those of the right-padded batch (fp32, 1e-5)."""
    from twinkle_core.models.lora_routing import RowGroup
    from twinkle_service.transformers_engine import TransformersEngine, _padding_free_row
    from twinkle_service.wire import DatumIn, ForwardBackwardIn

    engine = TransformersEngine(str(tiny_model_dir), max_tenants=2, max_rank=8, mixed_precision="no")
    assert engine.model.padding_free
    engine.create("alice", 4, seed=1)
    engine.create("bob", 8, seed=2)
    with torch.no_grad():  # LoRA B starts at zero: give both adapters an effect on the outputs
        for name, param in engine.model.model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.05)

    def request(name, rows, loss_fn="cross_entropy"):
        data = []
        for tokens in rows:
            ids = np.array(tokens[:-1])
            inputs = {"target_tokens": np.array(tokens[1:]), "weights": np.linspace(0, 1, len(ids), dtype=np.float32)}
            if loss_fn != "cross_entropy":
                inputs = {"target_tokens": inputs["target_tokens"], "advantages": inputs["weights"] - 0.5,
                          "logprobs": np.full(len(ids), -3.0, np.float32)}
            data.append(DatumIn(ids, inputs))
        return ForwardBackwardIn(name, 0, loss_fn, {}, data, False)

    # alice's third row opens with the 6 tokens of her first: the pass holds them once
    requests = [request("alice", [ROWS[0], ROWS[1]]), request("bob", [ROWS[2]], "ppo"),
                request("alice", [ROWS[0][:6] + [9, 10, 11]])]
    data = [requests[i].data[j] for i, j in ((0, 0), (0, 1), (2, 0), (1, 0))]
    batch, spans, _ = _padding_free_row(data, [RowGroup("alice", 0, 3), RowGroup("bob", 3, 4)])
    assert batch["input_ids"].shape[1] == sum(len(d.tokens) for d in data) - 6
    assert batch["prefix_spans"].tolist() == [[0, 0], [0, 0], [0, 6], [0, 0]]
    assert [(g.adapter, g.start, g.stop) for g in spans] == [("alice", 0, 15), ("bob", 15, 25)]
    runs = {}
    for padding_free in (True, False):
        engine.model.padding_free = padding_free
        outcomes = engine.forward_backward(requests)
        grads = {n: p.grad.clone() for n, p in engine.model.model.named_parameters() if p.grad is not None}
        engine.model.model.zero_grad(set_to_none=True)
        runs[padding_free] = (outcomes, grads)
    (free, free_grads), (padded, padded_grads) = runs[True], runs[False]
    for a, b in zip(free, padded):
        assert a.error is None and a.result[1]["loss:sum"] == pytest.approx(b.result[1]["loss:sum"], rel=1e-5)
        for x, y in zip(a.result[0], b.result[0]):
            np.testing.assert_allclose(x["logprobs"], y["logprobs"], atol=1e-5)
    assert {n.split(".")[-2] for n in free_grads} >= {"alice", "bob"} and free_grads.keys() == padded_grads.keys()
    for name, grad in free_grads.items():
        torch.testing.assert_close(grad, padded_grads[name], atol=1e-5, rtol=1e-4, msg=name)


def _megatron_run(url: str, key: str, seed: int) -> dict:
    """Create a rank-4 model, 2 cross-entropy steps, save_state, 2 more and a ppo step; a greedy sample."""
    client = _client(url, key)
    training = client.create_lora_training_client(base_model=NAME, rank=4, seed=seed).result()
    data = [_datum(t, 3) for t in ROWS]
    out = {"start": [o["logprobs"].to_numpy() for o in training.forward(data, "cross_entropy").result().loss_fn_outputs]}
    topk = [types.Datum(model_input=types.ModelInput.from_ints(t[:-1]),  # [N, 3] targets (top-K distillation)
                        loss_fn_inputs={"target_tokens": np.array([[x, 7, 99] for x in t[1:]]),
                                        "weights": np.ones((len(t) - 1, 3), np.float32)}) for t in ROWS]
    out["start_k"] = [o["logprobs"].to_numpy() for o in training.forward(topk, "cross_entropy").result().loss_fn_outputs]
    losses = []
    for step in range(4):
        losses.append(training.forward_backward(data, "cross_entropy").result().metrics["loss:sum"])
        training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        if step == 1:
            out["mid"] = training.save_state("mid").result().path
    sampled = training.forward(data, "cross_entropy").result().loss_fn_outputs
    ppo = [types.Datum(model_input=d.model_input,
                       loss_fn_inputs={"target_tokens": d.loss_fn_inputs["target_tokens"],
                                       "logprobs": o["logprobs"].to_numpy() - 0.05,
                                       "advantages": np.linspace(-0.5, 1.0, len(o["logprobs"].to_numpy()),
                                                                 dtype=np.float32)})
           for d, o in zip(data, sampled)]
    losses.append(training.forward_backward(ppo, "ppo").result().metrics["loss:sum"])
    training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    out["losses"] = losses
    out["end"] = [o["logprobs"].to_numpy() for o in training.forward(data, "cross_entropy").result().loss_fn_outputs]
    sampler_path = training.save_weights_for_sampler("end").result().path
    sampler = client.create_sampling_client(model_path=sampler_path).result()
    greedy = sampler.sample(types.ModelInput.from_ints([5, 6, 7, 8]), 2,
                            types.SamplingParams(max_tokens=4, temperature=0.0, stop=[])).result()
    out["greedy"] = [(s.tokens, s.logprobs) for s in greedy.sequences]
    out["client"] = client
    return out


def test_megatron_backend_splits_the_base_over_tp_ranks_and_equals_one_process(tiny_model_dir, tmp_path):
    """--backend megatron: the base split over 2 tensor-parallel workers, and 2 data-parallel workers, train as
    1 worker does (1e-5 relative), its first log-probabilities are the Hugging Face model's (1e-5), and its
    saved adapter is a plain PEFT adapter of the HF model."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    runs = {}
    for layout, (nproc, tp) in {"tp2": (2, 2), "dp2": (2, 1), "one": (1, 1)}.items():
        config = ServiceConfig(model_id=str(tiny_model_dir), model_name=NAME, tokenizer_id=str(tiny_model_dir),
                               mixed_precision="no", max_tenants=2, max_lora_rank=8, max_length=64,
                               backend="megatron", nproc_per_node=nproc, tp_size=tp, state_dir=tmp_path / "state")
        server, thread, _, url = _serve(config)
        try:
            runs[layout] = _megatron_run(url, "tml-nina", seed=11)
            if layout == "one":  # the tp=2 state: its weights load on another layout, its optimizer shards do not
                client = runs[layout]["client"]
                with pytest.raises(Exception, match="tp_size': 2.*load the weights only"):
                    client.create_training_client_from_state_with_optimizer(runs["tp2"]["mid"]).result()
                resumed = client.create_training_client_from_state(runs["tp2"]["mid"]).result()
                loss = resumed.forward([_datum(t, 3) for t in ROWS], "cross_entropy").result().metrics["loss:sum"]
                assert loss == pytest.approx(runs["tp2"]["losses"][2], rel=1e-5)
            runs[layout]["client"].close("success").result()
        finally:
            server.should_exit = True
            thread.join(60)
    one, two = runs["one"], runs["tp2"]
    assert one["losses"][3] < one["losses"][0] and abs(one["losses"][4]) > 1e-3  # training; a ppo loss, not ~0
    for split in (runs["tp2"], runs["dp2"]):
        np.testing.assert_allclose(split["losses"], one["losses"], rtol=1e-5)
        for a, b in zip(one["end"], split["end"]):
            np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5)
        assert [t for t, _ in split["greedy"]] == [t for t, _ in one["greedy"]]
        np.testing.assert_allclose(np.array([lp for _, lp in split["greedy"]]),
                                   np.array([lp for _, lp in one["greedy"]]), atol=1e-5)
    # The untrained adapter is the base: the Hugging Face model's log-probabilities; the trained one, saved for
    # sampling, loads on the HF base with PEFT and gives the server's last log-probabilities.
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()

    def hf_logprobs(m):
        with torch.no_grad():
            return [torch.log_softmax(m(input_ids=torch.tensor([t[:-1]])).logits[0].float(), -1)
                    .gather(-1, torch.tensor(t[1:])[:, None])[:, 0].numpy() for t in ROWS]

    for ours, hf in zip(two["start"], hf_logprobs(model)):
        np.testing.assert_allclose(ours, hf, atol=1e-5)
    with torch.no_grad():
        for ours, t in zip(two["start_k"], ROWS):  # each position's [target, 7, 99] log-probabilities
            every = torch.log_softmax(model(input_ids=torch.tensor([t[:-1]])).logits[0].float(), -1)
            expected = every.gather(-1, torch.tensor([[x, 7, 99] for x in t[1:]])).numpy()
            np.testing.assert_allclose(ours, expected, atol=1e-5)
    run_folder = quote(two["mid"].removeprefix("tinker://").split("/")[0], safe="")  # the server's layout
    folder = next(p for p in (tmp_path / "state").rglob("end") if (p / "adapter").is_dir() and run_folder in str(p))
    peft = PeftModel.from_pretrained(model, folder / "adapter").eval()
    for ours, hf in zip(two["end"], hf_logprobs(peft)):
        np.testing.assert_allclose(ours, hf, atol=1e-5)
