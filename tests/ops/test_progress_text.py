"""The progress artifact's text: step / total and an ETA from this attempt's pace (a resume not counted)."""
from tasks.train import describe_progress


def test_eta_follows_the_pace_of_the_steps_trained_in_this_attempt():
    assert describe_progress(30, 120, 0, 60.0) == "step 30/120, ETA 3 min 0 s"  # 2 s per step, 90 to go
    assert describe_progress(30, 120, 20, 20.0) == "step 30/120, ETA 3 min 0 s"  # resumed at 20: 10 steps in 20 s
    assert describe_progress(118, 120, 0, 59.0) == "step 118/120, ETA 1 s"
    assert describe_progress(120, 120, 0, 60.0) == "step 120/120"
    assert describe_progress(20, 120, 20, 0.0) == "step 20/120"  # no step trained yet in this attempt
