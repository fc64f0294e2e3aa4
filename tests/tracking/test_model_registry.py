"""Registration against a real MLflow SQLite store: candidate always, champion only when it wins."""
import pytest
from mlflow import MlflowClient

from twinkle_core.tracking import redact, register_version


@pytest.fixture
def client(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    return MlflowClient(tracking_uri=uri, registry_uri=uri)


def _run_with_model(client, tmp_path, eval_loss):
    experiment = client.get_experiment_by_name("t") or client.get_experiment(client.create_experiment(
        "t", artifact_location=(tmp_path / "artifacts").as_uri()))
    run = client.create_run(experiment.experiment_id)
    model_dir = tmp_path / f"adapter-{run.info.run_id}"
    model_dir.mkdir()
    (model_dir / "adapter_config.json").write_text("{}")
    client.log_artifacts(run.info.run_id, str(model_dir), "model")
    client.log_metric(run.info.run_id, "eval_loss", eval_loss)
    return run.info.run_id


def test_champion_moves_only_to_a_better_eval_loss(client, tmp_path):
    decisions = []
    for loss in (2.0, 2.5, 1.5):
        run_id = _run_with_model(client, tmp_path, loss)
        decisions.append(register_version(client, "tiny", run_id, "model", loss))
    assert [d.version for d in decisions] == ["1", "2", "3"]
    assert [d.promoted for d in decisions] == [True, False, True]
    assert str(client.get_model_version_by_alias("tiny", "champion").version) == "3"
    assert str(client.get_model_version_by_alias("tiny", "candidate").version) == "3"
    assert "does not beat" in decisions[1].decision() and "2.5000" in decisions[1].decision()
    assert "2.0000" in decisions[1].decision()


def test_redact_hides_secret_values_and_flattens():
    flat = redact({"lr": 0.1, "hub": {"token": "hf_abc", "name": "x"}, "api_key": "k", "password": None})
    assert flat == {"lr": "0.1", "hub.token": "***", "hub.name": "x", "api_key": "***", "password": "None"}
