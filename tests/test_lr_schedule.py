"""The warm-up + cosine schedule DeepSpeed steps: never lr 0, peak at the end of warm-up, the floor at
the last step, and a skipped update does not advance it."""

import pytest
import torch

from parallel.runtime.lr_schedule import lr_factor, warmup_cosine
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
