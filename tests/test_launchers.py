"""Sweep launcher presets (configs/hydra/launcher) and the SLURM -> torch.distributed environment."""
from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import time

import pytest
from conftest import REPO, TINY, free_port
from tread.schema import compose
from tread.runtime.slurm import export_slurm_env, first_host, master_port, slurm_dist_env, tasks_per_node

SLURM_TARGET = "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher"
JOBLIB_TARGET = "hydra_plugins.hydra_joblib_launcher.joblib_launcher.JoblibLauncher"
BASIC_TARGET = "hydra._internal.core_plugins.basic_launcher.BasicLauncher"
# A quick CLI run: no evaluation, no periodic checkpoints, two steps.
QUICK = [o for o in TINY if not o.startswith("eval.every")] + [
    "eval.every_steps=0", "eval.at_end=false", "train.max_steps=2", "checkpoint.every_steps=0"]


def compose_hydra(*overrides: str):
    """The training config with its `hydra` node, as `python train.py -m <overrides>` would see it."""
    return compose(list(overrides), "train", return_hydra_config=True)


def make_launcher(cfg):
    """The launcher Hydra would build for a sweep (through its plugin registry); nothing is launched."""
    from hydra.core.plugins import Plugins
    from hydra.types import HydraContext

    return Plugins.instance().instantiate_launcher(hydra_context=HydraContext(config_loader=None, callbacks=None),
                                                   task_function=lambda cfg: None, config=cfg)


@pytest.mark.parametrize("choice,target", [(None, BASIC_TARGET), ("basic", BASIC_TARGET),
                                           ("parallel", JOBLIB_TARGET), ("slurm", SLURM_TARGET)])
def test_each_preset_composes_and_builds_its_launcher(choice, target, tmp_path):
    cfg = compose_hydra(*([f"hydra/launcher={choice}"] if choice else []), f"hydra.sweep.dir={tmp_path}")
    assert cfg.hydra.runtime.choices["hydra/launcher"] == (choice or "basic")  # basic stays the default
    assert cfg.hydra.launcher._target_ == target
    launcher = make_launcher(cfg)
    assert f"{type(launcher).__module__}.{type(launcher).__name__}" == target


def test_parallel_preset_keys():
    launcher = compose_hydra("hydra/launcher=parallel").hydra.launcher
    assert launcher.n_jobs == 2 and launcher.prefer == "processes"
    assert compose_hydra("hydra/launcher=parallel", "hydra.launcher.n_jobs=4").hydra.launcher.n_jobs == 4
    assert make_launcher(compose_hydra("hydra/launcher=parallel", "hydra.launcher.n_jobs=4")).joblib["n_jobs"] == 4


def test_slurm_preset_defaults_and_overrides(tmp_path):
    defaults = compose_hydra("hydra/launcher=slurm", f"hydra.sweep.dir={tmp_path}").hydra.launcher
    assert (defaults.partition, defaults.nodes, defaults.gpus_per_node, defaults.tasks_per_node,
            defaults.cpus_per_task, defaults.mem_gb, defaults.timeout_min) == (None, 1, 8, 8, 8, None, 1440)
    assert defaults.submitit_folder == f"{tmp_path}/.submitit/%j"
    cfg = compose_hydra("hydra/launcher=slurm", "hydra.launcher.nodes=4", "hydra.launcher.gpus_per_node=4",
                        "hydra.launcher.partition=gpu", "hydra.launcher.timeout_min=240",
                        "hydra.launcher.mem_gb=480", "hydra.launcher.cpus_per_task=12", f"hydra.sweep.dir={tmp_path}")
    launcher = cfg.hydra.launcher
    assert (launcher.nodes, launcher.gpus_per_node, launcher.partition, launcher.timeout_min, launcher.mem_gb,
            launcher.cpus_per_task) == (4, 4, "gpu", 240, 480, 12)
    assert launcher.tasks_per_node == 4  # follows gpus_per_node: one process per GPU
    params = make_launcher(cfg).params   # what the launcher hands to submitit, interpolations resolved
    assert params["tasks_per_node"] == 4 and params["submitit_folder"] == f"{tmp_path}/.submitit/%j"
    explicit = compose_hydra("hydra/launcher=slurm", "hydra.launcher.tasks_per_node=1").hydra.launcher
    assert (explicit.gpus_per_node, explicit.tasks_per_node) == (8, 1)


def test_readme_slurm_example_composes(tmp_path):
    """The README's 4-node sweep (one of its three ratios): launcher keys, and the experiment it trains."""
    cfg = compose_hydra("hydra/launcher=slurm", "hydra.launcher.partition=gpu", "hydra.launcher.nodes=4",
                        "hydra.launcher.gpus_per_node=8", "hydra.launcher.timeout_min=2880",
                        "experiment=imagenet256_dit_b2_tread", "data.path=/data/in256-sdvae",
                        "eval.reference=/data/VIRTUAL_imagenet256_labeled.npz", "routing.routes.0.selection_ratio=0.25",
                        f"hydra.sweep.dir={tmp_path}")
    params = make_launcher(cfg).params
    assert {k: params[k] for k in ("partition", "nodes", "gpus_per_node", "tasks_per_node", "timeout_min")} == {
        "partition": "gpu", "nodes": 4, "gpus_per_node": 8, "tasks_per_node": 8, "timeout_min": 2880}
    assert cfg.model.arch == "DiT-B/2" and cfg.routing.routes[0].selection_ratio == 0.25
    assert cfg.train.batch_size % (4 * 8) == 0  # the global batch splits over the 32 processes


def test_slurm_launcher_writes_the_expected_sbatch_script(tmp_path, monkeypatch):
    """Run the launcher's own launch() up to submission: submitit checks the parameters and writes the sbatch
    text, which we read instead of calling sbatch (a fake `srun` on PATH: submitit looks for one)."""
    import submitit

    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "srun").write_text("#!/bin/sh\nexit 1\n")
    (tmp_path / "bin" / "srun").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    sweep = tmp_path / "sweep"
    cfg = compose_hydra("hydra/launcher=slurm", "hydra.launcher.nodes=4", "hydra.launcher.gpus_per_node=8",
                        "hydra.launcher.partition=gpu", "hydra.launcher.timeout_min=240", "hydra.launcher.mem_gb=480",
                        f"hydra.sweep.dir={sweep}")
    seen = {}

    class Done:
        def results(self):
            return ["result"]

    def fake_map_array(executor, fn, *args):
        seen["script"] = executor._executor._make_submission_file_text(executor._executor._submitit_command_str, "x")
        seen["jobs"] = list(zip(*args))
        return [Done() for _ in args[0]]

    monkeypatch.setattr(submitit.AutoExecutor, "map_array", fake_map_array)
    launcher = make_launcher(cfg)
    assert launcher.launch([["routing.routes.0.selection_ratio=0.25"], ["routing.routes.0.selection_ratio=0.5"]],
                           initial_job_idx=0) == ["result", "result"]
    lines = seen["script"].splitlines()
    for flag in ("--nodes=4", "--gpus-per-node=8", "--ntasks-per-node=8", "--cpus-per-task=8", "--partition=gpu",
                 "--time=240", "--mem=480GB", f"--output={sweep}/.submitit/%j/%j_0_log.out"):
        assert f"#SBATCH {flag}" in lines, (flag, seen["script"])
    assert "export SUBMITIT_EXECUTOR=slurm" in lines
    assert any(line.startswith("srun ") and "submitit.core._submit" in line for line in lines)  # one task per rank
    assert [(job[0], job[2]) for job in seen["jobs"]] == [(["routing.routes.0.selection_ratio=0.25"], 0),
                                                         (["routing.routes.0.selection_ratio=0.5"], 1)]


def test_sweep_dir_travels_resolved_to_the_jobs():
    """${now:...} in hydra.sweep.dir is resolved once in the submitting process and the value is pickled with
    the launcher's config, so every SLURM job and task of a sweep writes under the same folder."""
    cfg = compose_hydra("hydra/launcher=slurm", "hydra.sweep.dir=/sweeps/${now:%H-%M-%S-%f}")
    first = str(cfg.hydra.sweep.dir)
    time.sleep(0.01)
    assert str(pickle.loads(pickle.dumps(cfg)).hydra.sweep.dir) == first


# --- SLURM -> torch.distributed -------------------------------------------------------------------------

SRUN_TASK = {  # task 3 of `srun` with 2 nodes x 4 tasks (what submitit runs for nodes=2, gpus_per_node=4)
    "SLURM_JOB_ID": "123456", "SLURM_PROCID": "3", "SLURM_LOCALID": "3", "SLURM_NODEID": "0",
    "SLURM_NTASKS": "8", "SLURM_STEP_NUM_TASKS": "8", "SLURM_STEP_TASKS_PER_NODE": "4(x2)",
    "SLURM_STEP_NODELIST": "gpu[007-008]", "SLURM_JOB_NODELIST": "gpu[007-008]", "SLURM_NODELIST": "gpu[007-008]",
}
DIST_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture
def clean_env(monkeypatch):
    """os.environ without these variables, and whatever the test (or export_slurm_env) sets removed afterwards:
    a RANK left behind would make later CLI tests wait for ranks that never come."""
    for var in [*DIST_VARS, *SRUN_TASK, "SLURMD_NODENAME"]:
        monkeypatch.setenv(var, "")  # recorded first, so teardown restores the original (absent) state
        monkeypatch.delenv(var)
    return monkeypatch


def test_export_slurm_env_sets_the_torch_distributed_variables(clean_env):
    for key, value in SRUN_TASK.items():
        clean_env.setenv(key, value)
    assert export_slurm_env() is not None
    assert {k: os.environ[k] for k in DIST_VARS} == {
        "RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "4", "MASTER_ADDR": "gpu007",
        "MASTER_PORT": str(20000 + 123456 % 40000)}
    assert export_slurm_env() is None  # RANK is set now: a second call changes nothing


def test_second_node_task(clean_env):
    env = {**SRUN_TASK, "SLURM_PROCID": "6", "SLURM_LOCALID": "2", "SLURM_NODEID": "1"}
    assert slurm_dist_env(env) == {"RANK": "6", "WORLD_SIZE": "8", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "4",
                                   "MASTER_ADDR": "gpu007", "MASTER_PORT": "23456"}


@pytest.mark.parametrize("case,change", [
    ("no SLURM", {k: None for k in SRUN_TASK}),
    ("one task", {"SLURM_STEP_NUM_TASKS": "1", "SLURM_NTASKS": "1", "SLURM_STEP_TASKS_PER_NODE": "1"}),
    # `accelerate launch` / torchrun inside the job already set up the ranks
    ("launcher set RANK", {"RANK": "0"}),
    ("launcher set LOCAL_RANK", {"LOCAL_RANK": "0"}),
    # a batch script or salloc shell that runs `python train.py` itself: the allocation's task count, no srun step
    ("batch script, no srun", {"SLURM_STEP_NUM_TASKS": None, "SLURM_STEP_TASKS_PER_NODE": None,
                               "SLURM_STEP_NODELIST": None, "SLURM_PROCID": "0", "SLURM_LOCALID": "0"}),
])
def test_export_slurm_env_is_a_no_op(clean_env, case, change):
    env = {k: v for k, v in {**SRUN_TASK, **change}.items() if v is not None}
    for key, value in env.items():
        clean_env.setenv(key, value)
    before = dict(os.environ)
    assert export_slurm_env() is None, case
    assert dict(os.environ) == before


def test_own_master_addr_and_port_are_kept():
    env = {**SRUN_TASK, "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "12345"}
    out = slurm_dist_env(env)
    assert (out["MASTER_ADDR"], out["MASTER_PORT"]) == ("10.0.0.1", "12345")
    export_slurm_env(env)
    assert env["RANK"] == "3" and env["MASTER_PORT"] == "12345"  # a plain dict works too (no os.environ change)


def test_uneven_tasks_per_node_leave_local_world_size_unset():
    out = slurm_dist_env({**SRUN_TASK, "SLURM_STEP_NUM_TASKS": "5", "SLURM_STEP_TASKS_PER_NODE": "3,2"})
    assert out["WORLD_SIZE"] == "5" and "LOCAL_WORLD_SIZE" not in out


def test_a_step_without_node_list_is_an_error():
    env = {k: v for k, v in SRUN_TASK.items() if not k.endswith("NODELIST")}
    with pytest.raises(RuntimeError, match="MASTER_ADDR"):
        slurm_dist_env(env)


@pytest.mark.parametrize("nodelist", ["gpu007", "gpu[007-010,012]", "gpu[007-010,012],cpu01", "cpu01,gpu[1-2]",
                                      "node-a[3,1]", "n[1-2]-ib[3-4]", "a[09-11]b,c[1-3]"])
def test_first_host_agrees_with_submitit(nodelist):
    from submitit.slurm.slurm import _parse_node_list

    assert first_host(nodelist) == _parse_node_list(nodelist)[0]


def test_tasks_per_node_and_port():
    assert tasks_per_node("8(x4)") == [8] * 4 and tasks_per_node("2(x2),1") == [2, 2, 1] and tasks_per_node("4") == [4]
    assert master_port("123456") == 23456 and master_port(None) == 29500
    assert master_port("123457") != master_port("123456")  # array elements (consecutive ids) get their own port


@pytest.mark.slow
def test_srun_tasks_join_one_accelerate_run(tmp_path):
    """Two processes started the way srun starts tasks (SLURM variables only) run train.py as one 2-process
    accelerate run (gloo on CPU): export_slurm_env() in train.py's task function forms the process group."""
    port = free_port()  # the job-id-derived one could be taken on a shared machine
    run = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k not in DIST_VARS and not k.startswith("SLURM")}
    env.update(TREAD_CACHE_DIR=str(tmp_path / "cache"), SLURM_JOB_ID="4242", SLURM_STEP_NUM_TASKS="2",
               SLURM_NTASKS="2", SLURM_STEP_TASKS_PER_NODE="2", SLURM_STEP_NODELIST="localhost", MASTER_PORT=str(port))
    procs = [subprocess.Popen([sys.executable, "train.py", *QUICK, "train.cpu=true", f"hydra.run.dir={run}"], cwd=REPO,
                              env={**env, "SLURM_PROCID": str(r), "SLURM_LOCALID": str(r)}, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(2)]
    outs = [p.communicate(timeout=900)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs[0][-3000:] + outs[1][-3000:]
    assert "world size 2, global batch 8 (4 per micro-batch)" in outs[0]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["final_step"] == 2
    assert sorted(p.name for p in (run / "checkpoints" / "step_0000002").iterdir()) == [
        "checkpoint.json", "ema.safetensors", "model.safetensors", "rng_rank0.safetensors", "rng_rank1.safetensors",
        "train_state.safetensors"]


@pytest.mark.slow
def test_parallel_preset_runs_a_real_sweep(tmp_path):
    from test_train import run_cli

    sweep = tmp_path / "sweep"
    proc, _ = run_cli(["train.py", "-m", "hydra/launcher=parallel", "hydra.launcher.n_jobs=2",
                       "routing.routes.0.selection_ratio=0.25,0.5", *QUICK, f"hydra.sweep.dir={sweep}"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Joblib.Parallel(n_jobs=2" in proc.stdout + proc.stderr  # the joblib launcher ran the jobs
    summaries = {d.name: json.loads((d / "summary.json").read_text()) for d in sweep.iterdir() if d.is_dir()}
    assert sorted(summaries) == ["0", "1"]
    assert all(s["status"] == "completed" and s["final_step"] == 2 for s in summaries.values())
    assert "routing.routes.0.selection_ratio=0.25" in summaries["0"]["overrides"]
    assert "routing.routes.0.selection_ratio=0.5" in summaries["1"]["overrides"]
