"""Learning-rate schedules (train.lr_schedule after train.lr_warmup_steps): equal to diffusers' get_scheduler lambdas
after the warm-up, the paper's warm-up (the first step already moves), the lr a run logs, and the config error."""
from __future__ import annotations

import math

import pytest
import torch
from diffusers.optimization import get_scheduler

from conftest import compose_cfg
from tread.schema import ConfigError, check_train
from tread.training.loop import train
from tread.training.run_log import read_metrics
from tread.training.step import lr_factor

DIFFUSERS_NAME = {"constant": "constant_with_warmup", "linear": "linear", "cosine": "cosine"}


@pytest.mark.parametrize("schedule", ["constant", "linear", "cosine"])
@pytest.mark.parametrize("warmup,total", [(0, 10), (3, 10), (4, 5), (7, 7)])
def test_after_the_warm_up_the_factor_is_diffusers(schedule, warmup, total):
    """Step k >= W: diffusers' LambdaLR factor at k (its scheduler stepped k times). Step k < W: (k + 1) / W, where
    diffusers' is k / W (its first step has lr 0)."""
    param = torch.nn.Parameter(torch.zeros(1))
    lam = get_scheduler(DIFFUSERS_NAME[schedule], torch.optim.SGD([param], lr=1.0), num_warmup_steps=warmup,
                        num_training_steps=total).lr_lambdas[0]
    for k in range(total):
        want = (k + 1) / warmup if k < warmup else lam(k)
        assert lr_factor(k, warmup, schedule, total) == want, (k, schedule)
    if schedule != "constant" and total - warmup > 1:
        assert 0 < lr_factor(total - 1, warmup, schedule, total) < lr_factor(warmup, warmup, schedule, total) == 1


def test_a_run_logs_the_scheduled_lr(tiny_cfg, tmp_path):
    cfg = tiny_cfg("train.max_steps=6", "train.lr_warmup_steps=2", "train.lr_schedule=cosine", "optimizer.lr=0.01",
                   "train.log_every_steps=1", "eval.every_steps=0", "eval.at_end=false", "checkpoint.every_steps=0")
    train(cfg, tmp_path / "run")
    logged = {r["step"]: r["lr"] for r in read_metrics(tmp_path / "run") if r.get("type") == "train"}
    assert sorted(logged) == [1, 2, 3, 4, 5, 6]
    for step, lr in logged.items():   # record `step` counts the updates done: the lr of update step - 1
        assert math.isclose(lr, 0.01 * lr_factor(step - 1, 2, "cosine", 6), rel_tol=1e-12)


def test_an_unknown_schedule_is_one_line():
    with pytest.raises(ConfigError) as err:
        check_train(compose_cfg(overrides=["train.lr_schedule=exponential"]))
    assert "train.lr_schedule" in str(err.value) and "\n" not in str(err.value).strip()
