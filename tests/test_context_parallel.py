"""Context parallelism with routing (train.context_parallel): a sequence split over 2 (and 4) gloo processes
equals one process routing the same sequence as that many shards.

Each case builds the same tiny model on every process, splits it (Ulysses, diffusers' templated attention),
runs one routed forward and backward on the same inputs and draws, and writes the gathered output, the
data-parallel mean of the parameter gradients (what DDP or FSDP hands the optimizer) and the keep count each
process routed. The reference is one process with `route_shards = degree` (routing/shards.py): same scores,
same kept tokens per shard. fp32 throughout; 1e-5 relative, as the acceptance states.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import family_checks as fc
from conftest import free_port
from tread.models.dit import build_dit
from tread.models.families.base import Embedded
from tread.routing.shards import check_split, shard_keep, top_per_shard
from tread.routing.spec import RouteConfigError
from tread.runtime.context_parallel import ContextParallel, build_context_parallel, ulysses_bytes

HALF = [{"selection_ratio": 0.5, "start_layer_idx": 1, "end_layer_idx": -2}]
DEEP = [{"selection_ratio": 0.75, "start_layer_idx": 0, "end_layer_idx": -1}]
ZERO = [{"selection_ratio": 0.0, "start_layer_idx": 1, "end_layer_idx": -2}]

# name -> (model, routes, force_keep, per-token timesteps); families at T = 3 (48 tokens), DiT at 16 tokens
CASES = {
    "dit-dense": ("dit", None, False, False),
    "dit-half": ("dit", HALF, False, False),
    "dit-deep-forced": ("dit", DEEP, True, False),
    "dit-zero": ("dit", ZERO, False, False),
    "dit-importance": ("dit-importance", HALF, False, False),
    "wan-half": ("wan", HALF, False, False),
    "wan-forced-per-token-t": ("wan", DEEP, True, True),
    "ltx_video-half": ("ltx_video", HALF, False, False),
    "cosmos-half": ("cosmos", HALF, False, False),
    "hunyuan_video-half": ("hunyuan_video", HALF, False, False),
    "flux-half": ("flux", HALF, False, False),
    "flux2-half": ("flux2", HALF, False, False),
    "qwen_image-half-masked-text": ("qwen_image", HALF, False, False),
    **{f"{name}-zero": (name, ZERO, False, False)
       for name in ("wan", "ltx_video", "cosmos", "hunyuan_video", "flux", "flux2", "qwen_image")},
}
MASKED = {"qwen_image-half-masked-text"}     # text of 4 tokens with a keep-mask per sample (split 2 + 2)
VIDEO = {"wan", "ltx_video", "cosmos", "hunyuan_video"}        # at T = 3 (48 tokens); images at 8 x 8 latents (16 tokens)
FOUR = ("dit-half", "wan-half", "flux-half")


def build(name: str, routes):
    """The case's tiny model, the same on every process (seeded), in train mode."""
    torch.manual_seed(0)
    if name.startswith("dit"):
        routing = fc.routing_cfg(routes)
        if name == "dit-importance":
            routing["selection"] = {"mode": "importance", "importance_weight": 0.5}
        model = build_dit("DiT-T/2", input_size=8, in_channels=4, num_classes=5, routing=routing)
    else:
        model = fc.make(name, routes, frames=3) if name in VIDEO else fc.make(name, routes)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():       # DiT's zero-initialised gates and head would make every output 0: perturb all
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    model.routing.router.manual_seed(11)
    return model.train()


def inputs(model, case):
    _, _, forced, per_token = CASES[case]
    x, t, y = fc.inputs(model, batch=2, frames=None if model.frames == 1 else 3)
    if per_token:
        t = fc.per_token_timesteps(model, batch=2)
    g = torch.Generator().manual_seed(3)
    keep = torch.rand(2, model.num_tokens, generator=g) < 0.3 if forced else None
    cond = fc.masked_text(model, batch=2, length=4) if case in MASKED else None
    return x, t, y, keep, cond


def step(model, case):
    """One forward and backward; (output, {name: grad}, local keep counts the router chose)."""
    x, t, y, force, cond = inputs(model, case)
    chosen, real = [], model.routing.router.select

    def select(*args, **kw):
        ids = real(*args, **kw)
        chosen.append(ids.shape[1])
        return ids

    model.routing.router.select = select
    out = model(x, t, y, force, cond=cond) if cond is not None else model(x, t, y, force)
    out.square().mean().backward()
    model.routing.router.select = real
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.detach(), grads, chosen


def _worker(rank: int, world: int, port: int, cases: list, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        split = build_context_parallel(world, "ulysses", torch.device("cpu"))
        for case in cases:
            model = build(CASES[case][0], CASES[case][1])
            model.use_context_parallel(split)
            out, grads, chosen = step(model, case)
            for g in grads.values():                      # the data-parallel mean DDP and FSDP take
                dist.all_reduce(g, op=dist.ReduceOp.AVG)
            everyone = [None] * world
            dist.all_gather_object(everyone, chosen)
            if rank == 0:
                torch.save({"out": out, "grads": grads, "chosen": everyone},
                           Path(out_dir) / f"{case}-{world}.pt")
    finally:
        dist.destroy_process_group()


def _spawn(world: int, cases, out_dir: Path) -> Path:
    """The ranks are forked from a fork server that has imported this module (and so torch and the families) but run
    no torch op: each starts in a fraction of a second instead of importing for seconds as a spawned process."""
    mp.set_forkserver_preload([__name__])
    mp.start_processes(_worker, args=(world, free_port(), list(cases), str(out_dir)), nprocs=world, join=True,
                       start_method="forkserver")
    return out_dir


@pytest.fixture(scope="module")
def split_two(tmp_path_factory):
    return _spawn(2, CASES, tmp_path_factory.mktemp("cp2"))


@pytest.fixture(scope="module")
def split_four(tmp_path_factory):
    return _spawn(4, FOUR, tmp_path_factory.mktemp("cp4"))


def reference(case: str, shards: int):
    model = build(CASES[case][0], CASES[case][1])
    model.route_shards = shards
    return step(model, case)


def assert_equal_runs(got: dict, want: tuple) -> None:
    out, grads, _ = want
    torch.testing.assert_close(got["out"], out, rtol=1e-5, atol=1e-5)
    assert got["grads"].keys() == grads.keys()
    for name, g in grads.items():
        torch.testing.assert_close(got["grads"][name], g, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("case", list(CASES))
def test_split_equals_one_process_on_the_same_kept_tokens(split_two, case):
    got = torch.load(split_two / f"{case}-2.pt")
    assert_equal_runs(got, reference(case, 2))


@pytest.mark.parametrize("case", list(CASES))
def test_every_process_keeps_the_same_count(split_two, case):
    got = torch.load(split_two / f"{case}-2.pt")
    chosen = got["chosen"]
    assert chosen[0] == chosen[1]
    _, want_grads, want_chosen = reference(case, 2)
    assert [2 * k for k in chosen[0]] == want_chosen     # a shard keeps half of the reference's per-shard picks
    if CASES[case][1] is not None and CASES[case][1] != ZERO:
        assert chosen[0], "the route ran"


@pytest.mark.parametrize("name", ["dit", "wan", "ltx_video", "cosmos", "hunyuan_video", "flux", "flux2", "qwen_image"])
def test_ratio_zero_under_the_split_equals_dense(split_two, name):
    """A route keeping every token, split over 2 processes, equals the dense model on one process."""
    got = torch.load(split_two / f"{name}-zero-2.pt")
    out, grads, _ = step(build(name, None), f"{name}-zero")
    assert out.abs().mean() > 0.1                           # the blocks and head compute something
    assert_equal_runs(got, (out, grads, None))


@pytest.mark.slow
@pytest.mark.parametrize("case", FOUR)
def test_four_processes(split_four, case):
    got = torch.load(split_four / f"{case}-4.pt")
    assert_equal_runs(got, reference(case, 4))
    assert len({tuple(c) for c in got["chosen"]}) == 1


def test_shards_route_apart_from_the_unsplit_choice():
    """The per-shard choice is a different (balanced) choice from the whole sequence's top-K: the reference above
    is not the unsplit run in disguise."""
    g = torch.Generator().manual_seed(0)
    score = torch.rand(4, 16, generator=g)
    ids = top_per_shard(score, 8, 2)
    assert ((ids < 8).sum(1) == 4).all() and ((ids >= 8).sum(1) == 4).all()
    for b in range(4):
        assert set(ids[b, :4].tolist()) == set(score[b, :8].topk(4).indices.tolist())
        assert set(ids[b, 4:].tolist()) == set((score[b, 8:].topk(4).indices + 8).tolist())
    whole = score.topk(8, dim=1).indices
    assert any(set(ids[b].tolist()) != set(whole[b].tolist()) for b in range(4))


def test_shard_keep_rounds_up_and_grows_to_the_forced_tokens():
    assert shard_keep(5, 16, 2) == 6                      # ceil(5 / 2) per shard
    assert shard_keep(8, 16, 4) == 8
    force = torch.zeros(2, 16, dtype=torch.bool)
    force[1, 8:15] = True                                 # 7 forced in the second shard of sample 1
    assert shard_keep(4, 16, 2, force) == 14
    with pytest.raises(RouteConfigError, match=r"train.context_parallel.degree=3: .* 16 routable tokens"):
        check_split(16, 3)


def test_local_shares_are_contiguous_and_in_order():
    split = ContextParallel(degree=4, index=2, mode="ulysses", group=None, parallel_config=None, backend="native",
                            data_rank=0, data_world=1)
    t = torch.arange(2 * 16 * 3).view(2, 16, 3)
    assert torch.equal(split.local(t), t[:, 8:12])


def test_ulysses_exchange_volume():
    """Per attention forward a process sends 3/4 of its query, key, value and output shards at degree 4."""
    assert ulysses_bytes(1, 75_600, 5120, 8) == pytest.approx(4 * 9450 * 5120 * 2 * 7 / 8)
    assert ulysses_bytes(2, 1024, 64, 4, bytes_per_value=4) == 4 * 2 * 256 * 64 * 4 * 3 / 4
    assert ulysses_bytes(1, 1024, 64, 1) == 0.0


# -- training: train.context_parallel against the launch, and a split run against one process --------------------

def test_bad_degrees_are_one_error_before_work(tiny_cfg, tmp_path):
    from tread.schema import ConfigError, check_train
    from tread.training.context_parallel import check_context_parallel
    from tread.training.loop import train

    with pytest.raises(ConfigError, match=r"train.context_parallel.degree=0 .*allowed: a positive integer"):
        check_train(tiny_cfg("train.context_parallel.degree=0"))
    with pytest.raises(ConfigError, match=r"train.context_parallel.mode='tree' .*allowed: ulysses .* or ring"):
        check_train(tiny_cfg("train.context_parallel.mode=tree"))
    config = check_train(tiny_cfg("train.context_parallel.degree=2"))
    with pytest.raises(ConfigError, match=r"degree=2 must divide the number of processes \(3\)"):
        check_context_parallel(config.train, 3, False)
    check_context_parallel(config.train, 4, False)
    ring = check_train(tiny_cfg("train.context_parallel.degree=2", "train.context_parallel.mode=ring"))
    with pytest.raises(ConfigError, match="mode=ring merges partial attentions .* on the CPU"):
        check_context_parallel(ring.train, 2, False)
    with pytest.raises(ConfigError, match="train.compile=true cannot be combined"):
        check_train(tiny_cfg("train.context_parallel.degree=2", "train.compile=true"))
    with pytest.raises(ConfigError, match="ema.mode=off cannot be combined with train.context_parallel.degree=2"):
        check_train(tiny_cfg("train.context_parallel.degree=2", "ema.mode=off"))
    check_train(tiny_cfg("train.context_parallel.degree=2", "ema.mode=trained"))
    with pytest.raises(ConfigError, match=r"degree=2 must divide the number of processes \(1\)"):
        train(tiny_cfg("train.context_parallel.degree=2"), tmp_path / "run")
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())


class _FakeSplit:
    degree, index, mode = 3, 0, "ulysses"

    def check_heads(self, heads, model):
        ContextParallel.check_heads(self, heads, model)


# ltx2 and wan_vace: subclasses of LTX-Video and Wan whose own streams (audio; the VACE blocks) do not split
@pytest.mark.parametrize("family", ["sd3", "pixart", "sana", "ltx2", "kandinsky5", "wan_vace"])
def test_families_that_cannot_split_refuse_in_one_line(family):
    from tread.models.errors import ModelConfigError

    model = fc.make(family)
    with pytest.raises(ModelConfigError, match=r"degree=3: model .* cannot split its sequence .* model=dit \| tread "
                                               r"\| wan \| ltx_video \| cosmos \| hunyuan_video \| flux \| flux2 \| qwen_image"):
        model.use_context_parallel(_FakeSplit())


def test_kontext_and_text_that_does_not_split_are_one_error():
    from tread.models.families import FamilyConfigError

    class Two(_FakeSplit):
        degree = 2

    with pytest.raises(FamilyConfigError, match="degree=2 cannot be combined with model.kontext=true"):
        fc.make("flux", kontext=True).use_context_parallel(Two())
    model = fc.make("flux")
    split = ContextParallel(degree=2, index=0, mode="ulysses", group=None, parallel_config=None, backend="native",
                            data_rank=0, data_world=1)
    emb = Embedded(torch.zeros(1, 16, 8), torch.zeros(1, 5, 8), {}, {"text_cos": torch.zeros(5, 4),
                                                                     "text_sin": torch.zeros(5, 4)}, (1, 4, 4))
    with pytest.raises(FamilyConfigError, match=r"degree=2: model.family=flux attends text and image jointly, so its 5 "
                                                r"text tokens .* must divide by the degree"):
        model.split_text(emb, split)
    emb.context, emb.extra = torch.arange(8.).view(1, 4, 2), {"text_cos": torch.arange(4.), "text_sin": torch.ones(4)}
    model.split_text(emb, split)
    assert emb.context.tolist() == [[[0, 1], [2, 3]]] and emb.extra["text_cos"].tolist() == [0, 1]


def test_heads_and_tokens_that_do_not_split_are_one_error():
    from tread.utils.errors import UserError

    with pytest.raises(UserError, match=r"degree=3: Ulysses gives each process 1/3 of the attention heads, but "
                                        r"model.family=wan has 4"):
        fc.make("wan").use_context_parallel(_FakeSplit())
    with pytest.raises(UserError, match=r"degree=3: Ulysses .* but DiT\S* has 4"):
        build_dit("DiT-T/2", input_size=8, in_channels=4, num_classes=5).use_context_parallel(_FakeSplit())


@pytest.mark.slow
def test_split_training_run_equals_one_process_and_resumes_exactly(cache_dir, tiny_cfg, tmp_path, monkeypatch):
    """debug=tiny (routed DiT-T/4, 16 tokens) on 2 processes as one context group of degree 2 logs the losses of one
    process routing the same 2 shards (rel. 1e-5), and a split run stopped at step 2 and resumed logs steps 3-4
    as the run that never stopped; so does FSDP over the same 2 processes (sharded checkpoint, resumed)."""
    from test_fsdp import QUIET, losses, torchrun
    from tread.routing.controller import RoutedBackbone
    from tread.training.loop import train

    common = [*QUIET, "train.context_parallel.degree=2", "checkpoint.every_steps=2"]
    torchrun(cache_dir, tmp_path / "split", *common, "train.max_steps=4")
    torchrun(cache_dir, tmp_path / "stopped", *common, "train.max_steps=2")
    torchrun(cache_dir, tmp_path / "stopped", *common, "train.max_steps=4", "resume=auto")
    fsdp = [*common, "train.parallel=fsdp"]
    torchrun(cache_dir, tmp_path / "fsdp", *fsdp, "train.max_steps=2")
    torchrun(cache_dir, tmp_path / "fsdp", *fsdp, "train.max_steps=4", "resume=auto")
    monkeypatch.setattr(RoutedBackbone, "route_shards", 2)
    train(tiny_cfg(*QUIET, "checkpoint.every_steps=0", "train.max_steps=4"), tmp_path / "one")
    a, b, c = losses(tmp_path / "split"), losses(tmp_path / "one"), losses(tmp_path / "stopped")
    assert sorted(a) == [1, 2, 3, 4] and all(abs(a[s] - b[s]) <= 1e-5 * abs(b[s]) for s in a), (a, b)
    assert sorted(c) == [1, 2, 3, 4] and all(abs(c[s] - a[s]) <= 1e-6 * abs(a[s]) for s in a), (c, a)
    d = losses(tmp_path / "fsdp")
    assert sorted(d) == [1, 2, 3, 4] and all(abs(d[s] - a[s]) <= 1e-5 * abs(a[s]) for s in a), (d, a)
    assert list((tmp_path / "fsdp" / "checkpoints" / "step_0000002").glob("**/*.distcp"))
    monkeypatch.setattr(RoutedBackbone, "route_shards", 1)
    train(tiny_cfg(*QUIET, "checkpoint.every_steps=0", "train.max_steps=4"), tmp_path / "unsplit")
    assert losses(tmp_path / "unsplit")[4] != b[4]        # the shards route other tokens than the whole sequence


def test_per_process_table_divides_tokens_and_counts_the_exchange():
    """memory_table.py --video ... --context-parallel D: activations at N / D by the measured law, and the bytes
    sent per step over every block's attention (forward, recompute, backward), routed blocks at their kept share."""
    from tread.perf.context_memory import PASSES, block_tokens, context_table, exchange_per_step

    assert block_tokens([(1, 2, 8, 16)], 4, 32) == [32, 16, 16, 32]
    assert exchange_per_step([(1, 2, 8, 16)], 4, 32, 64, 2) == PASSES * sum(
        ulysses_bytes(1, n, 64, 2) for n in (32, 16, 16, 32))
    rows = [{"family": "wan", "preset": "tiny", "route": route, "tokens": n, "activations": 1000 + per * n,
             "routes": stats} for route, per, stats in (("none", 10, []), ("paper", 6, [(2, 4, 1, 2)]))
            for n in (16, 48)]
    table = context_table(rows, 4, frames=(1, 3), latents=(8, 8)).splitlines()
    assert table[0].startswith("| model | degree | T | tokens | tokens / process |")
    cells = [c.strip() for c in table[3].split("|")[1:-1]]           # T = 3: 48 tokens, 12 per process
    assert cells[1:5] == ["4", "3", "48", "12"]
    assert float(cells[6]) == pytest.approx((1000 + 10 * 12) / 2 ** 30, abs=0.005)
    width, depth = 64, 8                                             # wan tiny: 4 heads x 16, 8 blocks
    assert float(cells[8]) == round(exchange_per_step([], depth, 48, width, 4) / 1e9, 1)
    routed = exchange_per_step([(2, 4, 1, 2)], depth, 48, width, 4)
    assert routed == pytest.approx(exchange_per_step([], depth, 48, width, 4) * (5 + 3 / 2) / 8)


def test_a_grid_that_does_not_split_is_refused_before_the_group_forms():
    """split_backbone checks the default grid before it builds the mesh (no process group is needed to refuse)."""
    from types import SimpleNamespace

    from tread.training.context_parallel import split_backbone

    train = SimpleNamespace(context_parallel=SimpleNamespace(degree=3, mode="ulysses"))
    model = build_dit("DiT-T/2", input_size=8, in_channels=4, num_classes=5)
    with pytest.raises(RouteConfigError, match=r"train.context_parallel.degree=3: the sequence has 16 routable tokens"):
        split_backbone(train, model, torch.device("cpu"))
    assert model.context_split is None


@pytest.mark.slow
@pytest.mark.parametrize("family", ["wan", "flux"])
def test_split_family_training_equals_one_process(cache_dir, tiny_cfg, tmp_path, monkeypatch, family):
    """A family trained split over 2 processes (cross-attended text: Wan; joint text: FLUX) logs the losses of one
    process routing the same shards (rel. 1e-5)."""
    from test_fsdp import QUIET, losses, torchrun
    from tread.routing.controller import RoutedBackbone
    from tread.training.loop import train

    common = [*QUIET, f"model={family}", "checkpoint.every_steps=0", "train.max_steps=3"]
    torchrun(cache_dir, tmp_path / "split", *common, "train.context_parallel.degree=2")
    monkeypatch.setattr(RoutedBackbone, "route_shards", 2)
    train(tiny_cfg(*common), tmp_path / "one")
    a, b = losses(tmp_path / "split"), losses(tmp_path / "one")
    assert sorted(a) == [1, 2, 3] and all(abs(a[s] - b[s]) <= 1e-5 * abs(b[s]) for s in a), (a, b)
