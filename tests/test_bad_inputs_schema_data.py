"""The schema's closed gaps and datasets checked once (issue 25, parts 4 and 5), as bad-input cases: architecture
overrides out of range or not fitting together, keys of another model (+model.sprint on a TREAD model), a FLUX or
SD3 without blocks (refused naming the layer count, not the route), values printed as typed in Hydra (resume=true,
not True); latents holding NaN/inf at various samples (recorded data changed in place, an older dataset without a
record, a record that itself says NaN), a malformed integrity record; and NaN reference statistics named by file
and key. Each is refused with one `error:` line before any work (the rules: tests/bad_input_table.py)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest

from bad_input_table import fid, refused, train
from tread.data import record_integrity
from tread.schema.model import FAMILY_ONLY

pytestmark = pytest.mark.slow   # ~35 program runs in the harness beside the other tables

Setup = Callable[[Path, dict], Any]


# ----------------------------------------------------------------------------- the schema's gaps

SCHEMA_CASES = [
    # keys of another model
    train("sprint_key_on_tread", "+model.sprint={{start:2,end:-3}}",
          needles=("model.sprint={{start: 2, end: -3}} is a key of model=sprint",
                   "model._target_=tread.models.build_dit does not take it")),
    train("sprint_without_its_key", "model=sprint", "~model.sprint",
          needles=("model.sprint is missing", "model._target_=tread.models.build_sprint")),
    train("sprint_span_beyond_depth", "model=sprint", "model.sprint.end=40",
          needles=("model.sprint.end=40 must be a block index in -12..11",)),
    train("dit_key_on_flux", "model=flux", "+model.depth=4", needles=("model.depth is not a known key",)),
    train("wan_key_on_flux", "model=flux", "+model.frames=2",
          needles=(f"model.frames is a key of model.family={' | '.join(FAMILY_ONLY['frames'])}; model.family=flux "
                  "does not take it",)),
    # DiT architecture overrides: each in its range, and fitting together (DiT-T/4 under debug=tiny)
    train("mlp_ratio_tiny", "+model.mlp_ratio=0.001", needles=("model.mlp_ratio=0.001 is not allowed", "[0.25, 16]")),
    train("mlp_ratio_huge", "+model.mlp_ratio=64", needles=("model.mlp_ratio=64 is not allowed",)),
    train("depth_zero", "+model.depth=0", needles=("model.depth=0 is not allowed", "[1, 128]")),
    train("depth_huge", "+model.depth=100000", needles=("model.depth=100000 is not allowed",)),
    train("hidden_size_tiny", "+model.hidden_size=2", needles=("model.hidden_size=2 is not allowed", "[8, 16384]")),
    train("hidden_size_not_a_multiple_of_4", "+model.hidden_size=98", "+model.num_heads=2",
          needles=("model.hidden_size=98 is not allowed; allowed: a multiple of 4",)),
    train("heads_zero", "+model.num_heads=0", needles=("model.num_heads=0 is not allowed", "[1, 256]")),
    train("heads_do_not_divide", "+model.num_heads=7",
          needles=("model.num_heads=7 does not divide model.hidden_size=96 (DiT-T/4's)",)),
    train("patch_zero", "+model.patch_size=0", needles=("model.patch_size=0 is not allowed", "[1, 16]")),
    train("patch_does_not_divide", "+model.patch_size=3",
          needles=("model.patch_size=3 does not divide model.input_size=16",)),
    # the families' diffusers geometry: the block count first, naming the key (not the route: "allowed 0..-1")
    train("flux_without_blocks", "model=flux", "model.config={{num_layers:0,num_single_layers:0}}",
          needles=("model.config.num_layers=0 and model.config.num_single_layers=0 leave the flux transformer "
                   "without blocks",)),
    train("sd3_without_blocks", "model=sd3", "model.config={{num_layers:0}}",
          needles=("model.config.num_layers=0 leaves the sd3 transformer without blocks",)),
    train("flux_layers_negative", "model=flux", "model.config={{num_layers:-3}}",
          needles=("model.config.num_layers=-3 is not allowed", "[0, 256]")),
    train("flux_heads_zero", "model=flux", "model.config={{num_attention_heads:0}}",
          needles=("model.config.num_attention_heads=0 is not allowed",)),
    train("wan_patch_out_of_range", "model=wan", "model.config={{patch_size:[1,2,40]}}",
          needles=("model.config.patch_size=[1, 2, 40] is not allowed",)),
    # values printed as typed in Hydra's syntax
    train("resume_true", "resume=true", needles=("resume=true is not allowed",)),
    train("resume_list", "resume=[true,null]", needles=("resume=[true, null] is not allowed",)),
    train("allow_nonfinite_string", "data.allow_nonfinite=maybe",
          needles=("data.allow_nonfinite='maybe' is not allowed", "allowed: false (a dataset holding NaN/inf")),
]


# ----------------------------------------------------------------------------- datasets checked once

def plant(path: Path, *indices: int, value: float = np.nan) -> None:
    """value into each sample of `indices` of the .npy file at `path`, in place (its mtime changes)."""
    array = np.load(path, mmap_mode="r+")
    for index in indices:
        array.reshape(len(array), -1)[index, index % array[0].size] = value
    array.flush()


def edit_meta(root: Path, change: Callable[[dict], Any]) -> None:
    meta = json.loads((root / "meta.json").read_text())
    change(meta)
    (root / "meta.json").write_text(json.dumps(meta))


def copy_data(edit: Callable[[Path], Any]) -> Setup:
    """A setup: a copy of the pristine dataset {data} (times kept: its record holds) as {out}/ds, edited."""
    def setup(out: Path, places: dict) -> None:
        shutil.copytree(places["data"], out / "ds")
        edit(out / "ds")
    return setup


def data(id: str, edit: Callable[[Path], Any], *needles: str) -> Any:
    return train(f"data_{id}", "data.builtin=null", "data.path={out}/ds", setup=copy_data(edit), needles=needles)


def bad_at(first: int, count: int = 1, changed: bool = True) -> tuple[str, ...]:
    """The needles of a refusal of {out}/ds/latents.npy whose first bad sample is `first`."""
    said = (f"'{{out}}/ds/latents.npy' holds NaN/inf in {count} of 400 samples, the first at index {first}",
            "data.allow_nonfinite=true")
    return said + (("digest differs from meta.json's record",) if changed else ())


def old(edit: Callable[[Path], Any]) -> Callable[[Path], Any]:
    """The dataset as written before integrity records were kept, then edited."""
    return lambda d: (edit_meta(d, lambda m: m.pop("integrity")), edit(d))


DATA_CASES = [
    # recorded data changed in place: the changed mtime makes the check read it (digest differs, NaN found)
    data("nan_first_sample", lambda d: plant(d / "latents.npy", 0), *bad_at(0)),
    data("nan_middle_sample", lambda d: plant(d / "latents.npy", 217), *bad_at(217)),
    data("inf_last_sample", lambda d: plant(d / "latents.npy", 399, value=np.inf), *bad_at(399)),
    data("neg_inf_two_samples", lambda d: plant(d / "latents.npy", 300, 5, value=-np.inf), *bad_at(5, 2)),
    data("nan_every_100th", lambda d: plant(d / "latents.npy", *range(99, 400, 100)), *bad_at(99, 4)),
    # an older dataset without a record: scanned, the NaN found the same way
    data("old_nan", old(lambda d: plant(d / "latents.npy", 123)), *bad_at(123, changed=False)),
    data("old_inf_last", old(lambda d: plant(d / "latents.npy", 399, value=np.inf)), *bad_at(399, changed=False)),
    # a record that itself says NaN (record_integrity of bad data): refused from the record, without a read
    data("recorded_nan", lambda d: (plant(d / "latents.npy", 42), record_integrity(d)), *bad_at(42, changed=False)),
    # the record itself broken
    data("integrity_not_a_mapping", lambda d: edit_meta(d, lambda m: m.update(integrity=[])),
         "{out}/ds/meta.json: key 'integrity' is []", "Delete the key"),
    data("integrity_unknown_digest", lambda d: edit_meta(d, lambda m: m["integrity"].update(digest="md4")),
         "{out}/ds/meta.json: key 'integrity'", "'digest': one of"),
]


# ----------------------------------------------------------------------------- reference statistics with NaN

def nan_stats(key: str) -> Setup:
    """A setup: {out}/r.npz, 64-d statistics (the toy classifier's width) with NaN in `key`."""
    def setup(out: Path, places: dict) -> None:
        stats = {"mu": np.zeros(64), "sigma": np.eye(64)}
        stats[key] = stats[key] * np.nan
        np.savez(out / "r.npz", **stats)
    return setup


REFERENCE_CASES = [
    fid("calc_ref_nan_mu", "mode=calc", "images={imgs}/cls0", "ref={out}/r.npz", setup=nan_stats("mu"),
        needles=("reference {out}/r.npz: key 'mu' holds NaN or inf",)),
    fid("calc_ref_nan_sigma", "mode=calc", "images={imgs}/cls0", "ref={out}/r.npz", setup=nan_stats("sigma"),
        needles=("reference {out}/r.npz: key 'sigma' holds NaN or inf",)),
    fid("bench_ref_nan_mu", "mode=bench", "checkpoints={run}", "ref={out}/r.npz", setup=nan_stats("mu"),
        needles=("reference {out}/r.npz: key 'mu' holds NaN or inf",)),
    train("eval_reference_nan_mu", "eval.reference={out}/r.npz", setup=nan_stats("mu"),
          needles=("reference {out}/r.npz: key 'mu' holds NaN or inf",)),
]

CASES = SCHEMA_CASES + DATA_CASES + REFERENCE_CASES


def test_the_table_is_big_enough():
    assert len(CASES) >= 20
    assert {c.program for c in CASES} == {"train.py", "fid.py"}


@pytest.mark.parametrize("case", [c.param() for c in CASES])
def test_bad_input_is_refused(world, case, record_property):
    refused(world, case, record_property)
