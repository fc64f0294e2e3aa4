"""Comparisons shared by the multi-process tests (tolerances: see test_parallel_equivalence)."""
import pytest

LOSS_RTOL = 1e-4
WEIGHT_ATOL = 1e-5


def assert_same_training(run, reference, loss_rtol=LOSS_RTOL, weight_atol=WEIGHT_ATOL):
    assert len(run.losses) == len(reference.losses) == 4
    for step, (got, want) in enumerate(zip(run.losses, reference.losses), start=1):
        assert abs(got - want) <= loss_rtol * abs(want), f"step {step}: loss {got} vs one process {want}"
    assert [s["trained_tokens"] for s in run.result["steps"]] == [s["trained_tokens"] for s in reference.result["steps"]]
    if weight_atol is None:
        return
    assert set(run.weights) == set(reference.weights)
    worst = max((run.weights[k] - reference.weights[k]).abs().max().item() for k in reference.weights)
    assert worst <= weight_atol, f"largest weight difference {worst}"


def assert_sharded_in_half(run):
    """Every rank holds half of each parameter and of the optimizer state (the local DTensor shards)."""
    for share in run.result["shares"]:
        assert share["param_bytes"] / share["param_full_bytes"] == pytest.approx(0.5, abs=0.01)
        assert share["optim_bytes"] / share["optim_full_bytes"] == pytest.approx(0.5, abs=0.01)
