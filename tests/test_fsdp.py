"""train.parallel=fsdp (tread/training/fsdp.py): config checks before work, and 2-process CPU (gloo) runs that match
DDP, with checkpoints a single-process run resumes from."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file

from conftest import TINY, launch_ranks
from tread.schema import ConfigError, check_train
from tread.training.fsdp import check_parallel
from tread.training.loop import train
from tread.checkpoint.files import load_model_file
from tread.checkpoint.sharded import SHARDED_DIR

QUIET = ["eval.every_steps=0", "eval.at_end=false"]
LORA = "model.lora={rank: 4, target_modules: [to_q, to_k, to_v, to_out.0]}"


def losses(run: Path) -> dict[int, float]:
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in recs if r["type"] == "train"}


def torchrun(cache_dir: Path, run: Path, *overrides: str) -> None:
    """train.py on 2 CPU processes with torchrun's environment (conftest.launch_ranks; a process group of several
    makes accelerate use gloo)."""
    done = launch_ranks("train.py", [*TINY, f"paths.cache_dir={cache_dir}", f"hydra.run.dir={run}", *overrides])
    assert done["rc"] == 0 and not done["timed_out"], done["stderr"][-4000:]


def max_diff(a: Path, b: Path, name: str) -> float:
    x, y = load_file(a / name), load_file(b / name)
    assert sorted(x) == sorted(y)
    return max(float((x[k] - y[k]).abs().max()) for k in x)


@pytest.mark.parametrize("overrides,world,cuda,needle", [
    ([], 1, False, "train.parallel=fsdp shards the model over processes but this launch has 1"),
    (["train.fsdp.cpu_offload=true"], 2, False, "train.fsdp.cpu_offload=true"),
    (["train.mixed_precision=fp16"], 2, True, "train.mixed_precision=fp16 is not supported"),
    (["eval.num_samples=21"], 2, False, "eval.num_samples=21 must be a multiple of the number of processes (2)"),
])
def test_bad_combinations_are_one_clear_error(tiny_cfg, overrides, world, cuda, needle):
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        config = check_train(tiny_cfg("train.parallel=fsdp", *overrides))
        check_parallel(config.train, config.eval, world, cuda)
    config = check_train(tiny_cfg("train.parallel=ddp", *overrides))
    check_parallel(config.train, config.eval, world, cuda)   # ddp ignores train.fsdp


def test_schema_and_one_process_run_refuse_before_work(tiny_cfg, tmp_path):
    with pytest.raises(ConfigError, match="train.parallel='zero3' is not allowed; allowed: ddp .* or fsdp"):
        check_train(tiny_cfg("train.parallel=zero3"))
    with pytest.raises(ConfigError, match="train.fsdp.cpu_offload='maybe'"):
        check_train(tiny_cfg("train.fsdp.cpu_offload=maybe"))
    with pytest.raises(ConfigError, match="launch has 1"):
        train(tiny_cfg("train.parallel=fsdp"), tmp_path / "run")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.slow
def test_dit_fsdp_matches_ddp_and_resumes_in_one_process(cache_dir, tiny_cfg, tmp_path):
    """Tiny TREAD DiT, 2 processes: FSDP logs the DDP run's losses (rel. 1e-5; bit-equal on the dev machine). Its
    checkpoint is sharded (checkpoint.layout=auto): each process wrote its own shards, and they hold the DDP
    checkpoint's weights and EMA (abs. 1e-6; ema.decay=0.5 so the EMA moves). A single-process resume of it logs
    what a resume of the DDP checkpoint logs, and a 2-process FSDP resume, each process reading its shards,
    continues like the DDP run that was never stopped (one launch: its step-4 checkpoint is the one compared).
    The two single-process resumes run in this process (train(), as train.py calls it: what they check is the
    loading of the shards without a process group, not a launch; a subprocess would add ~5 s of imports each)."""
    common = [*QUIET, "ema.decay=0.5", "checkpoint.every_steps=4"]
    torchrun(cache_dir, tmp_path / "fsdp", *common, "train.max_steps=4", "train.parallel=fsdp")
    torchrun(cache_dir, tmp_path / "ddp", *common, "train.max_steps=6")
    a, b = losses(tmp_path / "fsdp"), losses(tmp_path / "ddp")
    assert sorted(a) == [1, 2, 3, 4] and all(abs(a[s] - b[s]) <= 1e-5 * abs(b[s]) for s in a), (a, b)
    ckpt = "checkpoints/step_0000004"
    assert sorted(p.name for p in (tmp_path / "fsdp" / ckpt / SHARDED_DIR).glob("*.distcp")) == \
        ["__0_0.distcp", "__1_0.distcp"]
    x, y = load_model_file(tmp_path / "fsdp" / ckpt), load_model_file(tmp_path / "ddp" / ckpt)
    for key in ("model", "ema"):
        assert sorted(x[key]) == sorted(y[key])
        assert max(float((x[key][k] - y[key][k]).abs().max()) for k in x[key]) < 1e-6
    more = [*QUIET, "ema.decay=0.5", "train.max_steps=6", "checkpoint.every_steps=0"]
    for src in ("fsdp", "ddp"):
        train(tiny_cfg(*more, f"resume={tmp_path / src / ckpt}"), tmp_path / f"one_{src}")
    c, d = losses(tmp_path / "one_fsdp"), losses(tmp_path / "one_ddp")
    assert sorted(c) == [5, 6] and all(abs(c[s] - d[s]) <= 1e-5 * abs(d[s]) for s in c), (c, d)
    torchrun(cache_dir, tmp_path / "fsdp", *more, "resume=auto", "train.parallel=fsdp")
    a, b = losses(tmp_path / "fsdp"), losses(tmp_path / "ddp")
    assert sorted(a) == list(range(1, 7)) and all(abs(a[s] - b[s]) <= 1e-5 * abs(b[s]) for s in a), (a, b)


@pytest.mark.slow
def test_flux_lora_checkpointing_fsdp_matches_ddp(cache_dir, tmp_path):
    """Tiny routed FLUX with LoRA (frozen base and adapters in one FSDP group) and gradient checkpointing: the same
    losses and exported adapter as DDP (rel. 1e-5 / abs. 1e-6). Two steps: LoRA's B starts at zero, so A gets its
    first gradient at step 2; after two steps both adapter matrices carry FSDP's reduced updates."""
    common = [*QUIET, "model=flux", LORA, "model.gradient_checkpointing=true", "train.max_steps=2",
              "checkpoint.every_steps=0"]
    # checkpoint.layout=single: the full weights gathered on rank 0 (the sharded layout: the test above); the
    # adapter export gathers only the adapters' shards either way.
    torchrun(cache_dir, tmp_path / "fsdp", *common, "train.parallel=fsdp", "train.fsdp.reshard_after_forward=false",
             "checkpoint.layout=single")
    torchrun(cache_dir, tmp_path / "ddp", *common)
    a, b = losses(tmp_path / "fsdp"), losses(tmp_path / "ddp")
    assert sorted(a) == [1, 2] and all(abs(a[s] - b[s]) <= 1e-5 * abs(b[s]) for s in a), (a, b)
    ckpt = "checkpoints/step_0000002"
    assert max_diff(tmp_path / "fsdp" / ckpt, tmp_path / "ddp" / ckpt, "adapter_model.safetensors") < 1e-6
