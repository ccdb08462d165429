"""REPA targets and their cost: the frozen encoder's forward FLOPs count in the run's training FLOPs while targets
are decoded from the latents each step (summary.json repa_targets, repa_encoder_flops_per_step), not when they were
precomputed; the time the targets take is logged per record (metrics.jsonl repa_target_sec)."""
from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from tread.schema import check_train
from tread.data import ensure_toy_classifier
from tread.encoders.patch import REPA_TOY_SEED, build_patch_encoder
from tread.training.loop import train
from tread.training.repa import Repa, TargetTimer
from tread.training.run_log import read_metrics
from tread.training.setup import build_parts, make_accelerator, open_dataset
from tread.training.summary import RunSummary

pytestmark = pytest.mark.usefixtures("one_thread")

QUIET = ["eval.every_steps=0", "eval.at_end=false", "checkpoint.every_steps=0", "train.log_every_steps=1"]
REPA = [*QUIET, "repa=toy", "train.max_steps=2"]


def base_summary(cfg, run_dir, repa=None) -> RunSummary:
    """The summary of a run of `cfg` at step 0 (its model and data built as training builds them) with `repa`."""
    config = check_train(cfg)
    parts = build_parts(config, make_accelerator(config.train))
    return RunSummary(run_dir, None, config, parts.model, open_dataset(config.data, parts.model, config.model.arch), 0,
                      repa=repa)


def counted_encoder_flops(cfg, batch: int) -> float:
    """The toy encoder's forward FLOPs on a batch of images, counted by torch on one forward of the whole batch."""
    side = int(cfg.data.resolution)
    weights = ensure_toy_classifier(str(cfg.paths.cache_dir), resolution=side, seed=REPA_TOY_SEED)
    encoder = build_patch_encoder("toy", weights=weights, resolution=side)
    with FlopCounterMode(display=False) as counter:
        encoder(torch.zeros(batch, 3, side, side))
    return float(counter.get_total_flops())


def test_decoded_targets_add_the_encoders_forward_to_the_run_flops(tiny_cfg, tmp_path):
    cfg = tiny_cfg(*REPA)
    summary = train(cfg, tmp_path / "run")
    batch = int(cfg.train.batch_size)
    encoder = counted_encoder_flops(cfg, batch)
    base = base_summary(tiny_cfg(*REPA), tmp_path / "base").flops_per_step     # no Repa: model + head only
    assert encoder > 0 and summary["repa_targets"] == "decoded"
    assert summary["repa_encoder_flops_per_step"] == pytest.approx(encoder)
    assert summary["train_flops_per_step"] == pytest.approx(base + encoder)
    assert summary["train_flops_run"] == pytest.approx(2 * (base + encoder))
    records = [r for r in read_metrics(tmp_path / "run") if r["type"] == "train"]
    assert len(records) == 2 and all(r["repa_target_sec"] > 0 for r in records)


@pytest.mark.parametrize("targets,added", [("decoded", 1), ("precomputed", 0)])
def test_precomputed_targets_add_no_encoder_flops(tiny_cfg, tmp_path, targets, added):
    cfg = tiny_cfg(*REPA)
    base = base_summary(cfg, tmp_path / "base").flops_per_step
    repa = Repa(torch.nn.Identity(), 0.5, {}, encoder_flops=1e6, targets=targets)
    summary = base_summary(cfg, tmp_path / "run", repa)
    batch = int(cfg.train.batch_size)
    assert summary.data["repa_targets"] == targets
    assert summary.data["repa_encoder_flops_per_step"] == added * batch * 1e6
    assert summary.flops_per_step == pytest.approx(base + added * batch * 1e6)
    assert summary.flops_between(0, 3) == pytest.approx(3 * (base + added * batch * 1e6))


def test_the_target_timer_sums_until_taken():
    timer = TargetTimer()
    for _ in range(2):
        with timer:
            torch.ones(64, 64).sum()
    first = timer.take()
    assert first > 0 and timer.take() == 0.0


def test_given_features_give_the_decode_paths_loss():
    """Repa.loss with features of the decoded images passed in (as stored targets would be) equals the decode path."""
    side, torch_gen = 16, torch.Generator().manual_seed(0)
    x = torch.rand(2, 3, side, side, generator=torch_gen) * 2 - 1
    projected, ids = torch.randn(2, 4, 128, generator=torch_gen), torch.tensor([[0, 5, 9, 15], [1, 2, 3, 4]])
    encoder = build_patch_encoder("toy_random", resolution=side)
    repa, meta = Repa(encoder, 0.5, {}, patch=(4, 4)), {"decode": {"type": "identity"}}
    images = ((x + 1) * 127.5).round().clamp(0, 255) / 127.5 - 1                 # identity data's decode
    decoded = repa.loss(projected, ids, x, meta).item()
    given = repa.loss(projected, ids, x, meta, features=encoder(images)).item()
    other = repa.loss(projected, ids, x, meta, features=encoder(-images)).item()    # another image's features
    assert given == pytest.approx(decoded, abs=1e-6) and other != pytest.approx(decoded, abs=1e-3)
