"""Schedule phases that change training hyperparameters (routing.schedule[i].train, path_drop_prob): the per-step
values, the schema's one-line errors, equivalence with the same settings in the config, the loader's batch sizes,
exact resume across a batch change, the summary's batch-aware FLOPs, and experiment=sprint_toy across its boundary."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from conftest import TINY, compose_cfg, shared_cache
from tread.schema import ConfigError, check_train
from tread.training.loop import train
from tread.training.run_log import read_metrics
from tread.training.setup import make_loader, open_dataset
from tread.training.step import StepSettings, lr_factor, step_lr

pytestmark = pytest.mark.usefixtures("one_thread")

QUIET = ["eval.every_steps=0", "eval.at_end=false", "checkpoint.every_steps=0", "train.log_every_steps=1"]
FT = "{lr:5e-4,batch_size:16,warmup_steps:2,grad_clip:0.5}"
SCHEDULE = f"routing.schedule=[{{start_step:0}},{{start_step:3,routes:[],train:{FT}}}]"


def records(run_dir):
    return {r["step"]: r for r in read_metrics(run_dir) if r["type"] == "train"}


def test_each_step_gets_its_phase_values_and_unset_keys_are_the_configs(tiny_cfg):
    cfg = tiny_cfg("train.lr_warmup_steps=4", "train.grad_clip=1.0", "train.max_steps=20", "routing.schedule=["
                   "{start_step:0},{start_step:5,train:{batch_size:16,grad_clip:0.5}},{start_step:8,train:{lr:0.01}},"
                   "{start_step:12,train:{warmup_steps:3}}]")
    cfg = check_train(cfg)
    phases, s = cfg.phases, StepSettings.from_config(cfg)
    assert [phases.at(k).batch_size for k in (0, 4, 5, 7, 8)] == [8, 8, 16, 16, 8]    # phase 2 leaves it out
    assert [phases.at(k).grad_clip for k in (4, 5, 8)] == [1.0, 0.5, 1.0]
    lr = cfg.optimizer.lr
    assert [step_lr(k, s) for k in range(7)] == [lr * lr_factor(k, 4, "constant", 20) for k in range(7)]
    assert step_lr(8, s) == step_lr(11, s) == 0.01                        # own lr, no warm-up: restarts at 8
    assert [step_lr(k, s) for k in (12, 13, 14, 15)] == [lr / 3, 2 * lr / 3, lr, lr]   # warm-up from step 12
    assert phases.batch_phases() == [(0, 8, None), (5, 16, 1), (8, 8, None)]
    assert phases.batch_sum(3, 9) == 8 + 8 + 16 * 3 + 8


def test_cosine_restarts_over_the_remaining_steps(tiny_cfg):
    cfg = tiny_cfg("train.lr_schedule=cosine", "train.max_steps=10",
                   "routing.schedule=[{start_step:0},{start_step:6,train:{lr:0.5}}]")
    s = StepSettings.from_config(check_train(cfg))
    assert [step_lr(k, s) for k in range(6, 10)] == [0.5 * lr_factor(k, 0, "cosine", 4) for k in range(4)]


@pytest.mark.parametrize("schedule, needle", [
    ("[{start_step:0,train:{lr:-1}}]", "routing.schedule[0].train.lr=-1"),
    ("[{start_step:0,train:{batch_size:0}}]", "routing.schedule[0].train.batch_size=0"),
    ("[{start_step:0,train:{warmup_steps:-2}}]", "routing.schedule[0].train.warmup_steps=-2"),
    ("[{start_step:0,train:{grad_clip:0}}]", "routing.schedule[0].train.grad_clip=0"),
    ("[{start_step:0,train:{batch:4}}]", "routing.schedule[0].train.batch"),
    ("[{start_step:0,steps:3}]", "routing.schedule[0].steps"),
    ("[{start_step:-1}]", "routing.schedule[0].start_step=-1"),
    ("[{start_step:0,path_drop_prob:1.5}]", "routing.schedule[0].path_drop_prob=1.5"),
    ("[{start_step:0},{start_step:2,path_drop_prob:0.0}]", "routing.schedule[1].path_drop_prob=0.0 is a key of "
                                                           "model=sprint"),
])
def test_bad_phase_keys_are_one_line_naming_the_key(tiny_cfg, schedule, needle):
    with pytest.raises(ConfigError) as err:
        check_train(tiny_cfg(f"routing.schedule={schedule}"))
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_a_batch_the_accumulation_cannot_split_is_refused(tiny_cfg):
    with pytest.raises(ConfigError, match=r"routing.schedule\[1\].train.batch_size=9 .*grad_accum_steps=2"):
        check_train(tiny_cfg("train.grad_accum_steps=2", "routing.schedule=[{start_step:0},"
                             "{start_step:2,train:{batch_size:9}}]"))


@pytest.mark.parametrize("phase, config", [      # the step's settings (lr, warm-up, clipping), the loader's batch
    ("train:{lr:5e-4,warmup_steps:2,grad_clip:0.01}", ["optimizer.lr=5e-4", "train.lr_warmup_steps=2",
                                                        "train.grad_clip=0.01"]),
    ("train:{batch_size:16}", ["train.batch_size=16"]),
])
def test_a_phase_from_step_0_equals_the_same_config(tiny_cfg, tmp_path, phase, config):
    train(tiny_cfg(*QUIET, "train.max_steps=3", *config), tmp_path / "config")
    train(tiny_cfg(*QUIET, "train.max_steps=3", f"routing.schedule=[{{start_step:0,{phase}}}]"), tmp_path / "phase")
    a, b = records(tmp_path / "config"), records(tmp_path / "phase")
    assert [a[s]["loss"] for s in a] == [b[s]["loss"] for s in b]
    assert [a[s]["lr"] for s in a] == [b[s]["lr"] for s in b]


def test_path_drop_from_step_0_equals_the_same_config(tiny_cfg, tmp_path):
    common = [*QUIET, "model=sprint", "train.max_steps=3"]
    train(tiny_cfg(*common, "model.sprint.path_drop_prob=0.5"), tmp_path / "config")
    train(tiny_cfg(*common, "routing.schedule=[{start_step:0,path_drop_prob:0.5}]"), tmp_path / "phase")
    train(tiny_cfg(*common, "model.sprint.path_drop_prob=0.0"), tmp_path / "none")
    a, b, c = (records(tmp_path / n) for n in ("config", "phase", "none"))
    assert [a[s]["loss"] for s in a] == [b[s]["loss"] for s in b] != [c[s]["loss"] for s in c]


def test_the_loader_hands_out_each_phases_batch_and_resumes_its_position(tiny_cfg):
    cfg = tiny_cfg("train.grad_accum_steps=2", "routing.schedule=[{start_step:0},{start_step:3,train:{batch_size:16}}]")
    acc = SimpleNamespace(num_processes=1, process_index=0, device=torch.device("cpu"))
    cfg = check_train(cfg)
    model = SimpleNamespace(in_channels=3, input_size=16, frames_axis=False, frames=1, i2v=False,
                            check_text_data=lambda *args: None)
    dataset = open_dataset(cfg.data, model, "DiT-T/4")
    loader = make_loader(cfg, dataset, acc)
    batches = [next(loader) for _ in range(10)]                 # 5 steps of 2 micro-batches
    assert [b[0].shape[0] for b in batches] == [4] * 6 + [8] * 4
    again = make_loader(cfg, dataset, acc)
    again.load_state_dict(loader.state_dict() | {"index": 5, "batch": 5, "epoch": 0})
    for want in batches[5:]:
        assert torch.equal(next(again)[0], want[0])


RESUMED = [*QUIET, "train.lr_warmup_steps=2", SCHEDULE]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The 5-step run each resume below must equal (on one thread, as the tests' own runs: one_thread)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run = tmp_path_factory.mktemp("uninterrupted") / "run"
        cache = shared_cache(tmp_path_factory)
        train(compose_cfg("train", [*TINY, f"paths.cache_dir={cache}", *RESUMED, "train.max_steps=5"]), run)
        return records(run)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("stop", [2, 3, 4])     # before, exactly at, and after the batch change
def test_resume_across_a_batch_change_is_exact(tiny_cfg, tmp_path, uninterrupted, stop):
    train(tiny_cfg(*RESUMED, f"train.max_steps={stop}"), tmp_path / "part")
    summary = train(tiny_cfg(*RESUMED, "train.max_steps=5", "resume=auto"), tmp_path / "part")
    a, b = uninterrupted, records(tmp_path / "part")
    assert sorted(b) == list(range(1, 6))
    assert [a[s]["loss"] for s in a] == [b[s]["loss"] for s in b]
    assert [a[s]["lr"] for s in a] == [b[s]["lr"] for s in b] == [5e-4, 1e-3, 1e-3, 2.5e-4, 5e-4]   # warm-ups of 2
    routed, dense = summary["schedule"]
    assert (routed["batch_size"], dense["batch_size"]) == (8, 16)
    assert summary["train_flops_total"] == pytest.approx(3 * routed["train_flops_per_step"]
                                                         + 2 * dense["train_flops_per_step"])
    share = routed["tokens_fraction"]                            # per sample: 3 x 8 routed, 2 x 16 dense
    assert summary["tokens_fraction_run"] == pytest.approx((24 * share + 32) / 56)


def test_a_dense_batch_phase_doubles_the_flops_of_a_dense_step(tiny_cfg, tmp_path):
    summary = train(tiny_cfg(*QUIET, "train.max_steps=2", "routing.schedule=[{start_step:0,routes:[]},"
                             "{start_step:1,routes:[],train:{batch_size:16}}]"), tmp_path / "run")
    first, second = summary["schedule"]
    assert second["train_flops_per_step"] == 2 * first["train_flops_per_step"]


def test_sprint_toy_composes_and_trains_across_its_boundary(tiny_cfg, tmp_path):
    cfg = tiny_cfg(*QUIET, "experiment=sprint_toy", "debug=tiny", "train.max_steps=4",
                   "routing.schedule.1.start_step=2", "routing.schedule.1.train.batch_size=16")
    assert cfg.routing.selection.mode == "structured" and cfg.model._target_ == "tread.models.build_sprint"
    ft = cfg.routing.schedule[1]
    assert (ft.routes, ft.train.lr, ft.train.warmup_steps, ft.path_drop_prob) == ([], 2e-3, 3, 0.1)
    summary = train(cfg, tmp_path / "run")
    recs = records(tmp_path / "run")
    assert [recs[s]["tokens_fraction"] < 1 for s in (1, 2, 3, 4)] == [True, True, False, False]
    assert [recs[s]["lr"] for s in (3, 4)] == pytest.approx([2e-3 / 3, 4e-3 / 3])
    assert [p["batch_size"] for p in summary["schedule"]] == [cfg.train.batch_size, 16]
