"""The RL-mode rule that turns stage times into a step time."""

import pytest

from rltune.steps import combine


def test_sync_adds_the_three_stages():
    assert combine("sync", 50.0, 30.0, 5.0) == (85.0, "rollout")


def test_one_step_async_overlaps_rollout_and_training():
    # The seed's worked example: max(50.0 rollout, 53.8 training) + 3.5 weight sync = 57.3 s.
    step, limiting = combine("one_step_async", 50.0, 53.8, 3.5)
    assert step == pytest.approx(57.3)
    assert limiting == "training"


@pytest.mark.parametrize("training, rollout, sync, step, limiting", [
    (450, 620, 30, 620, "rollout"),                # baseline of the seed's Figure 3
    (370, 470, 30, 470, "rollout"),                # candidate A
    (370, 390, 30, 400, "training+weight_sync"),   # candidate B: training becomes the limit
    (350, 440, 30, 440, "rollout"),                # candidate C
])
def test_fully_async_figure_3(training, rollout, sync, step, limiting):
    assert combine("fully_async", rollout, training, sync) == (step, limiting)


def test_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="unknown RL mode 'async'"):
        combine("async", 1, 1, 1)
