"""evaluate: held-out loss, perplexity and greedy answers of the base and trained models."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from mlflow import MlflowClient
from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact

from tasks.refs import CheckpointRef, ModelRef, TokenizedRef
from twinkle_core.evaluate import EvalRunConfig
from twinkle_core.launch import run_streaming
from twinkle_core.tracking import tracking_uri


def _table(reports: dict, prompts: list[list[dict]]) -> str:
    rows = ["| model | eval loss | perplexity |", "|---|---|---|"]
    rows += [f"| {k} | {r['eval_loss']:.4f} | {r['perplexity']:.2f} |" for k, r in reports.items()]
    for i, messages in enumerate(prompts):
        rows += ["", f"**prompt:** {messages[-1]['content']}"]
        rows += [f"- {label}: {r['answers'][i]}" for label, r in reports.items()]
    return "\n".join(rows)


@task
def evaluate(model: ModelRef, checkpoint: CheckpointRef, heldout: TokenizedRef, prompts: list[list[dict]],
             run_dir: str, mixed_precision: str, max_new_tokens: int = 48, mlflow_run_id: str | None = None,
             timeout_s: float | None = None) -> dict:
    """Evaluate base and trained in one worker process; log to MLflow and a markdown artifact."""
    log = get_run_logger()
    run_dir = Path(run_dir)
    config = EvalRunConfig(
        model_path=Path(model.path), **model.ref_options(),
        checkpoints={"base": None, "trained": Path(checkpoint.path)},
        heldout_data=Path(heldout.path), prompts=prompts, max_new_tokens=max_new_tokens,
        mixed_precision=mixed_precision, result_path=run_dir / "eval.json",
    )
    config_path = run_dir / "eval_config.json"
    config_path.write_text(config.model_dump_json(indent=2))
    run_streaming([sys.executable, "-m", "twinkle_core.evaluate", str(config_path)], log.info, timeout_s=timeout_s)
    reports = json.loads(config.result_path.read_text())
    if mlflow_run_id:
        client = MlflowClient(tracking_uri())
        for label, report in reports.items():
            prefix = "eval" if label == "trained" else f"{label}_eval"
            client.log_metric(mlflow_run_id, f"{prefix}_loss", report["eval_loss"])
            client.log_metric(mlflow_run_id, f"{prefix}_perplexity", report["perplexity"])
        client.log_dict(mlflow_run_id, reports, "eval/report.json")
    create_markdown_artifact(_table(reports, prompts), key="evaluation", description="held-out evaluation")
    create_table_artifact([{"model": label, "eval_loss": round(r["eval_loss"], 4), "perplexity": round(r["perplexity"], 2),
                            "eval_tokens": r["eval_tokens"]} for label, r in reports.items()],
                          key="eval-results", description="held-out loss and perplexity, base vs trained")
    return reports
