"""scripts/compare_paper.py (tread/cli/compare_paper.py, tread/perf/paper.py) against a stand-in PAPER_DIR written
here: the paper code itself is never vendored (its licence forbids copying), so these files only have its layout and its
interfaces (top-level `dit`, `edm`, `routing_module`, a `utils` folder without `__init__.py`, a deepspeed import). Ours
all live under `tread`, so the paper's modules import under their own names, from PAPER_DIR, with the project root on
sys.path (as under pytest) and without deepspeed installed.
"""
from __future__ import annotations

import inspect
import json
import sys
import textwrap

import pytest
import torch

from tread.cli.compare_paper import main, our_overrides
from conftest import compose_cfg
from tread.perf.paper import PaperBench, PaperCodeError, import_paper

STAND_IN = {
    "routing_module.py": "CALLS = []\n",
    "dit.py": """
        import inspect
        import torch
        import torch.nn as nn
        import routing_module

        inspect.getmodule(inspect.currentframe())     # as its @torch.compile does: maps every module to its file

        class Net(nn.Module):
            def __init__(self, input_size, in_channels, num_classes, routes):
                super().__init__()
                self.input_size, self.in_channels, self.num_classes = input_size, in_channels, num_classes
                self.routes = routes
                self.lin = nn.Linear(in_channels, in_channels)

            def forward(self, x, t, y, class_drop_prob=0.0):
                routing_module.CALLS.append((len(self.routes), class_drop_prob))
                return self.lin(x.movedim(1, -1)).movedim(-1, 1)

        def get_model(backbone_type, params):
            return Net(params["input_size"], params["in_channels"], params["num_classes"],
                       params["routes"] if params["enable_routing"] else [])
        """,
    "edm.py": """
        import torch
        import torch.nn as nn
        from utils.edm_helper import *

        class Precond(nn.Module):
            def __init__(self, model):
                super().__init__()
                self.model = model

            def forward(self, x, sigma, y, **kw):
                return self.model(x, sigma.flatten(), y, **kw)

        class EDMDiffusion(nn.Module):
            def wrap_model_with_precond(self, model):
                return Precond(model)

            def get_training_loss(self, net, x, y=None, class_drop_prob=0.1):
                sigma = torch.rand(x.shape[0], 1, 1, 1) + 0.1
                return (net(x + sigma * torch.randn_like(x), sigma, y, class_drop_prob=class_drop_prob) - x) ** 2
        """,
    "utils/edm_helper.py": "import deepspeed\nfrom deepspeed.runtime.zero.partition_parameters import ZeroParamStatus\n",
    "utils/train_helper.py": """
        import torch

        @torch.no_grad()
        def update_ema(ema_model, model, decay=0.9999):
            for e, p in zip(ema_model.parameters(), model.parameters()):
                e.mul_(decay).add_(p, alpha=1 - decay)
        """,
}


@pytest.fixture
def paper_dir(tmp_path):
    root = tmp_path / "tread"
    for name, text in STAND_IN.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(textwrap.dedent(text))
    yield root
    # each test imports its own stand-in: forget the previous one (the harness itself leaves them imported)
    for name in [n for n in sys.modules if n.split(".")[0] in ("dit", "edm", "routing_module", "utils", "deepspeed")]:
        sys.modules.pop(name, None)


def test_the_paper_code_imports_beside_ours_from_paper_dir(paper_dir):
    ours, path, finders = sys.modules["tread.utils"], list(sys.path), list(sys.meta_path)
    inspect.getmodule(inspect.currentframe())                           # inspect's module-to-file map knows ours
    paper = import_paper(paper_dir)
    assert sys.modules["tread.utils"] is ours                           # ours untouched
    assert sys.path == path and sys.meta_path == finders                # the import path as it was
    for module in (paper.dit, paper.edm, paper.train_helper, sys.modules["routing_module"]):
        assert module.__file__.startswith(str(paper_dir))
    from accelerate.utils import is_deepspeed_available
    assert not is_deepspeed_available()                                 # the deepspeed stub is no installed package


def test_a_utils_package_elsewhere_does_not_shadow_the_papers(paper_dir, tmp_path, monkeypatch):
    other = tmp_path / "elsewhere"
    for name in ("utils/__init__.py", "utils/train_helper.py", "dit.py"):   # a regular package would win on sys.path
        (other / name).parent.mkdir(parents=True, exist_ok=True)
        (other / name).write_text("raise ImportError('imported from elsewhere')\n")
    monkeypatch.syspath_prepend(str(other))
    paper = import_paper(paper_dir)
    assert paper.train_helper.__file__.startswith(str(paper_dir)) and paper.dit.__file__.startswith(str(paper_dir))


def test_a_second_paper_dir_in_one_process_is_one_error(paper_dir, tmp_path):
    import_paper(paper_dir)
    other = tmp_path / "other"
    for name, text in STAND_IN.items():
        (other / name).parent.mkdir(parents=True, exist_ok=True)
        (other / name).write_text(textwrap.dedent(text))
    with pytest.raises(PaperCodeError, match=r"imported before \(dit from .*/tread/dit.py; edm from"):
        import_paper(other)


def test_a_folder_that_is_not_the_paper_code_is_one_error(tmp_path, paper_dir):
    with pytest.raises(SystemExit) as exit_info:                     # printed as one line, exit status 1
        main([str(tmp_path / "nowhere")])
    message = str(exit_info.value.code)
    assert message.startswith("error: PAPER_DIR") and "missing dit.py" in message and "\n" not in message
    (paper_dir / "edm.py").unlink()
    with pytest.raises(PaperCodeError, match="missing edm.py"):
        import_paper(paper_dir)


@pytest.mark.parametrize("flags, needle", [
    (["--sizes", "DiT-S/2:16"], "--sizes 'DiT-S/2:16' is not ARCH:RESOLUTION:BATCH"),
    (["--sizes", "DiT-S/2:16:10000000"], "--sizes 'DiT-S/2:16:10000000' is not ARCH:RESOLUTION:BATCH"),
    (["--steps", "0"], "argument --steps: '0' is not allowed: an integer in [1, 10000000]"),
    (["--warmup", "-1"], "argument --warmup: '-1' is not allowed: an integer in [0, 10000000]"),
    (["--rounds", "0"], "argument --rounds: '0' is not allowed: an integer in [1, 10000]"),
    (["--threads", "²"], "argument --threads: '²' is not allowed: an integer in [1, 4096]"),
])
def test_bad_flags_are_one_error_before_the_paper_code_is_imported(flags, needle, tmp_path):
    with pytest.raises(SystemExit) as exit_info:                     # a missing PAPER_DIR would be reported later
        main([str(tmp_path / "nowhere"), *flags])
    message = str(exit_info.value.code)
    assert message == f"error: {needle}" or (message.startswith("error: ") and needle in message)
    assert "\n" not in message and "PAPER_DIR" not in message


def test_both_steps_are_timed_interleaved_and_reported(paper_dir, tmp_path, capsys, monkeypatch):
    from tread.cli import compare_paper
    from tread.training import setup
    monkeypatch.setattr(setup, "compile_by_default", lambda device: False)   # auto stays eager: a quick test
    monkeypatch.setattr(compare_paper, "mixed_precision", lambda setting, device: ("bf16", "auto: native bf16"))
    # Our compiled steps through dynamo's eager backend: traced and run compiled, without an inductor build per
    # precision and route (most of this test's time; inductor itself: tests/test_compile.py).
    overrides = compare_paper.our_overrides
    monkeypatch.setattr(compare_paper, "our_overrides",
                        lambda *a, **k: [*overrides(*a, **k), "train.compile_backend=eager"])
    out = main([str(paper_dir), "--sizes", "DiT-T/4:8:2", "--precisions", "fp32", "bf16", "--steps", "2",
                "--warmup", "1", "--rounds", "2", "--compile", "false", "default", "--json", str(tmp_path / "c.json")])
    calls = sys.modules["routing_module"].CALLS
    assert {c[1] for c in calls} == {0.1}                               # its label dropout in every step
    assert sum(c[0] == 1 for c in calls) == sum(c[0] == 0 for c in calls) == 2 * (1 + 2)   # routed = dense calls
    rows = out["rows"]
    assert [(r["precision"], r["compile"]) for r in rows] == [("fp32", "false"), ("fp32", "default"),
                                                                ("bf16", "false"), ("bf16", "default")]
    for r in rows:
        assert r["ratio_dense"] == pytest.approx(r["ours_dense_ms"] / r["paper_dense_ms"])
        assert r["ours_speedup"] == pytest.approx(r["ours_dense_ms"] / r["ours_routed_ms"])
    assert rows[0]["paper_dense_ms"] == rows[1]["paper_dense_ms"]      # one paper step per precision
    assert rows[3]["vs_paper_fp32_dense"] == pytest.approx(rows[3]["ours_dense_ms"] / rows[0]["paper_dense_ms"])
    assert len(out["step_ms_all"]) == 12 and all(len(v) == 2 for v in out["step_ms_all"].values())
    assert json.loads((tmp_path / "c.json").read_text())["rows"] == rows
    printed = capsys.readouterr().out
    assert "| DiT-T/4:8:2 | bf16 | default |" in printed
    r = rows[3]                                                         # auto picks bf16 here: defaults vs defaults
    assert out["defaults"] in printed and "-> bf16 (auto: native bf16)" in out["defaults"]
    assert (f"| DiT-T/4:8:2 | bf16 | {r['ours_dense_ms']:.0f} ms / {r['ours_routed_ms']:.0f} ms | "
            f"{r['vs_paper_fp32_dense']:.2f}x / {r['vs_paper_fp32_routed']:.2f}x |") in out["defaults"]


def test_our_side_is_train_py_with_our_defaults():
    ov = our_overrides("DiT-S/2", 16, 32, dense=False, bf16=True, compile="default")
    assert "routing=paper" in ov and "train.mixed_precision=bf16" in ov
    cfg = compose_cfg("train", ov)                                    # train.yaml's own defaults: no experiment
    assert cfg.train.compile == "auto" and cfg.train.grad_clip is None and cfg.train.label_dropout == 0.1
    assert cfg.optimizer.lr == 1e-4 and cfg.ema.decay == 0.9999 and cfg.model.arch == "DiT-S/2"
    assert "train.compile=false" in our_overrides("DiT-S/2", 16, 32, True, False, "false")


def test_the_papers_model_and_ema_run_on_the_device_of_the_batch(paper_dir):
    """On CUDA the batch is on the GPU: the paper's net and EMA must be there too (the meta device stands in for
    it here: a model left on the CPU would keep CPU parameters)."""
    paper = import_paper(paper_dir)
    batch = (torch.empty(2, 4, 8, 8, device="meta"), torch.zeros(2, dtype=torch.long, device="meta"))
    bench = PaperBench(paper, "DiT-S/2", 8, 4, batch, None, bf16=False)
    devices = {p.device.type for p in [*bench.net.parameters(), *bench.ema.parameters()]}
    assert devices == {"meta"} and bench.device.type == "meta"
