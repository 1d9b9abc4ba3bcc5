"""The warm-up + cosine schedule DeepSpeed steps: never lr 0, peak at the end of warm-up, the floor at
the last step, and a skipped update does not advance it."""

import math

import pytest
import torch

from parallel.runtime.lr_schedule import CosineSegment, apply_current_lr, lr_factor, warmup_cosine
from schema.training import TrainConfig


def test_warm_up_is_linear_from_the_first_step():
    assert [lr_factor(s, 4, 20, 0.1) for s in range(1, 5)] == [0.25, 0.5, 0.75, 1.0]


def test_cosine_decays_monotonically_to_the_floor_at_the_last_step():
    decay = [lr_factor(s, 4, 20, 0.1) for s in range(4, 21)]
    assert all(a > b for a, b in zip(decay, decay[1:]))
    assert decay[-1] == pytest.approx(0.1)
    assert lr_factor(12, 4, 20, 0.1) == pytest.approx(0.55)  # half-way: the mean of peak and floor
    assert lr_factor(25, 4, 20, 0.1) == pytest.approx(0.1)  # past the end (a longer resumed run): the floor


def test_without_warm_up_the_first_step_decays_from_the_peak():
    assert 0.1 < lr_factor(1, 0, 10, 0.1) < 1.0
    assert lr_factor(10, 0, 10, 0.1) == pytest.approx(0.1)


def test_scheduler_sets_each_step_lr_on_the_optimizer():
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.AdamW([param], lr=1e-3)
    scheduler = warmup_cosine(optimizer, TrainConfig(lr=1e-3, warmup_steps=2, steps=4, min_lr_ratio=0.0))
    seen = []
    for _ in range(4):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert seen == pytest.approx([5e-4, 1e-3, 5e-4, 0.0])


def _floor_at_end(segment, warmup, steps, ratio=0.1):
    return lr_factor(segment.end_step, warmup, steps, ratio, segment)


@pytest.mark.parametrize("resumed, old_steps, new_steps", [(12, 20, 40), (12, 20, 16), (20, 20, 40), (3, 20, 40)])
def test_a_changed_train_steps_re_stretches_the_decay_without_a_jump(resumed, old_steps, new_steps):
    old = CosineSegment.fresh(4, old_steps)
    new = old.stretched(resumed, 4, new_steps)
    before = [lr_factor(s, 4, old_steps, 0.1, old) for s in range(1, resumed + 1)]
    after = [lr_factor(s, 4, new_steps, 0.1, new) for s in range(resumed, new_steps + 1)]
    assert after[0] == pytest.approx(before[-1])  # the resumed step stands where the old schedule left it
    decay = before[-1:] + after[1:] if resumed > 4 else after[4 - resumed :]
    assert all(a >= b for a, b in zip(decay, decay[1:]))  # never up again
    # no cliff down either: no step falls by more than the cosine's steepest slope over what is left of it
    start = max(resumed, 4)
    left = 1.0 - old.progress(start) if resumed > 4 else 1.0
    steepest = (1.0 - 0.1) * 0.5 * math.pi * left / (new_steps - start)
    assert max(a - b for a, b in zip(decay, decay[1:])) <= steepest + 1e-12
    assert _floor_at_end(new, 4, new_steps) == pytest.approx(0.1)  # the floor at the new last step


def test_a_finished_run_extended_trains_its_new_steps_at_the_floor():
    new = CosineSegment.fresh(4, 20).stretched(20, 4, 40)
    assert [lr_factor(s, 4, 40, 0.1, new) for s in range(21, 41)] == pytest.approx([0.1] * 20)


def test_an_unchanged_length_keeps_the_schedule_exactly():
    old = CosineSegment.fresh(4, 20)
    assert old.stretched(12, 4, 20) is old
    assert [lr_factor(s, 4, 20, 0.1, old) for s in range(1, 21)] == [lr_factor(s, 4, 20, 0.1) for s in range(1, 21)]


def test_a_loaded_scheduler_gives_the_next_step_the_new_schedules_lr():
    """As a resume does it: the checkpoint's scheduler state, loaded into this launch's scheduler, then the
    optimizer's learning rate for the next step set from this launch's schedule."""
    train_old = TrainConfig(lr=1e-3, warmup_steps=2, steps=8, min_lr_ratio=0.1)
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.AdamW([param], lr=1e-3)
    scheduler = warmup_cosine(optimizer, train_old)
    for _ in range(6):
        optimizer.step()
        scheduler.step()
    state = scheduler.state_dict()

    train_new = TrainConfig(lr=1e-3, warmup_steps=2, steps=12, min_lr_ratio=0.1)
    segment = CosineSegment.fresh(2, 8).stretched(6, 2, 12)
    optimizer = torch.optim.AdamW([param], lr=optimizer.param_groups[0]["lr"])  # the checkpoint's optimizer lr
    resumed = warmup_cosine(optimizer, train_new, segment)
    resumed.load_state_dict(state)
    apply_current_lr(resumed)
    seen = []
    for _ in range(6):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        resumed.step()
    assert seen == pytest.approx([1e-3 * lr_factor(s, 2, 12, 0.1, segment) for s in range(7, 13)])
    assert seen[0] < 1e-3 * lr_factor(6, 2, 8, 0.1) and seen[-1] == pytest.approx(1e-4)
