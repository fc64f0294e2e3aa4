"""evaluate: held-out loss, perplexity and greedy answers of the base and trained models."""
from __future__ import annotations

from pathlib import Path

from prefect import task
from prefect.artifacts import create_markdown_artifact, create_table_artifact

from tasks.eval_worker import log_eval_reports, run_eval_worker
from tasks.refs import CheckpointRef, ModelRef, TokenizedRef
from twinkle_core.data.vision_rows import content_text
from twinkle_core.evaluate import EvalRunConfig


def _table(reports: dict, prompts: list[list[dict]]) -> str:
    rows = ["| model | eval loss | perplexity |", "|---|---|---|"]
    rows += [f"| {k} | {r['eval_loss']:.4f} | {r['perplexity']:.2f} |" for k, r in reports.items()]
    for i, messages in enumerate(prompts):
        rows += ["", f"**prompt:** {content_text(messages[-1]['content'])}"]
        rows += [f"- {label}: {r['answers'][i]}" for label, r in reports.items()]
    return "\n".join(rows)


@task
def evaluate(model: ModelRef, checkpoint: CheckpointRef, heldout: TokenizedRef, prompts: list[list[dict]],
             run_dir: str, mixed_precision: str, max_new_tokens: int = 48, mlflow_run_id: str | None = None,
             timeout_s: float | None = None, objective: str = "causal_lm", objective_options: dict | None = None,
             ) -> dict:
    """Evaluate base and trained in one worker process; log to MLflow and a markdown artifact.
    `objective`: how the models load and the held-out rows batch (vision_lm: with their images)."""
    run_dir = Path(run_dir)
    config = EvalRunConfig(
        model_path=Path(model.path), **model.ref_options(),
        checkpoints={"base": None, "trained": Path(checkpoint.path)},
        heldout_data=Path(heldout.path), prompts=prompts, max_new_tokens=max_new_tokens,
        mixed_precision=mixed_precision, result_path=run_dir / "eval.json",
        objective=objective, objective_options=objective_options or {},
    )
    reports = run_eval_worker("twinkle_core.evaluate", config, run_dir / "eval_config.json", timeout_s)
    log_eval_reports(mlflow_run_id, reports,
                     lambda report: {"loss": report["eval_loss"], "perplexity": report["perplexity"]})
    create_markdown_artifact(_table(reports, prompts), key="evaluation", description="held-out evaluation")
    create_table_artifact([{"model": label, "eval_loss": round(r["eval_loss"], 4), "perplexity": round(r["perplexity"], 2),
                            "eval_tokens": r["eval_tokens"]} for label, r in reports.items()],
                          key="eval-results", description="held-out loss and perplexity, base vs trained")
    return reports
