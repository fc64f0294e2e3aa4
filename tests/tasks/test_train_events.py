"""The train task's reading of the workers' step events: total throughput, MFU and memory when sent."""
import pytest

from tasks.train import describe_step, step_metrics

STEP = {"event": "step", "step": 3, "total": 10, "loss": 1.25, "lr": 1e-3, "grad_norm": 0.5, "tokens_per_s": 400.0}


def test_total_tokens_per_s_is_per_rank_times_world_size():
    assert step_metrics({**STEP, "world_size": 4})["tokens_per_s_total"] == 1600.0
    assert step_metrics(STEP)["tokens_per_s_total"] == 400.0  # one process when the event does not say
    assert step_metrics({**STEP, "world_size": 4, "tokens_per_s_total": 1500.0})["tokens_per_s_total"] == 1500.0


def test_the_log_line_shows_mfu_and_peak_memory_only_when_sent():
    plain = describe_step(STEP)
    assert plain.startswith("step 3/10 loss 1.2500") and "400 tokens/s per rank, 400 total" in plain
    assert "MFU" not in plain and "peak memory" not in plain
    full = describe_step({**STEP, "tokens_per_s_total": 800.0, "mfu": 0.0234, "peak_memory_mb": 2730.4})
    assert "800 total" in full and "MFU 2.3%" in full and "peak memory 2730 MB" in full
    assert step_metrics({**STEP, "mfu": 0.0234})["mfu"] == pytest.approx(0.0234)


def test_an_objectives_own_metrics_reach_the_summary_and_the_log_line():
    event = {**STEP, "rewards/accuracy": 0.75, "rewards/margin": 0.125, "logps/chosen": -12.5}
    metrics = step_metrics(event)
    assert metrics["rewards/accuracy"] == 0.75 and metrics["logps/chosen"] == -12.5
    assert "reward accuracy 0.75, margin 0.125" in describe_step(event)
