"""Generation from seeds: every sample has its own noise generator (and, when routing at inference, its own
router generator), so the images are the same whatever the batch size or number of processes. Shared by
in-training evaluation, sample.py and fid.py mode=bench."""
from __future__ import annotations

from typing import Any, Callable, Iterator, Optional, Sequence

import torch

from tread.data import COND_KEYS, has_model_conditioning
from tread.diffusion import StackedRandomGenerator
from tread.models.families.first_frame import FIRST_FRAME, conditioned, restore_frames
from tread.sampling.guidance import UNCOND, Guidance, backbone, per_sample_routing

CondFn = Callable[[list[int]], dict]   # seeds -> per-sample conditioning (text embeddings) for those seeds


def class_for_seed(seed: int, num_classes: int) -> int:
    """Class-balanced labels: sample i gets class i mod K (the grid then has one column per class)."""
    return seed % num_classes


def parse_seeds(seeds: Any, num_samples: int) -> list[int]:
    """null -> 0..num_samples-1; "a-b" -> a..b inclusive; "1,5,7" or a list -> as given."""
    if seeds is None:
        return list(range(num_samples))
    if isinstance(seeds, int):
        return [seeds]
    if isinstance(seeds, str):
        out: list[int] = []
        for part in seeds.split(","):
            if "-" in part.strip()[1:]:
                a, b = part.split("-", 1)
                out.extend(range(int(a), int(b) + 1))
            elif part.strip():
                out.append(int(part))
        return out
    return [int(s) for s in seeds]


CLASS_LABELS = ("cycle", "random")    # class_labels: seed i gets class i mod K | its own generator draws it


def batch_labels(seeds: Sequence[int], start: int, num_classes: int, classes: Optional[Sequence[int]],
                 device: torch.device, gen: Optional[StackedRandomGenerator] = None) -> torch.Tensor:
    """Labels of the batch seeds[start:start + len]: `classes` cycled; else with generators `gen` each sample's class
    drawn from its own generator after its noise; else class_for_seed."""
    if classes is None and gen is not None:
        return gen.randint(0, num_classes, size=[len(seeds)], device=device)
    if classes is None:
        labels = [class_for_seed(s, num_classes) for s in seeds]
    else:
        labels = [classes[(start + j) % len(classes)] for j in range(len(seeds))]
    return torch.tensor(labels, device=device, dtype=torch.long)


@torch.no_grad()
def generate(net, diffusion, seeds: Sequence[int], shape: Sequence[int], num_classes: int, device: torch.device,
             *, batch_size: int, classes: Optional[Sequence[int]] = None, num_steps: Optional[int] = None,
             cond_fn: Optional[CondFn] = None, guidance: Optional[Guidance] = None, stats: Optional[dict] = None,
             uncond_fn: Optional[CondFn] = None, class_labels: str = "cycle"
             ) -> Iterator[tuple[list[int], torch.Tensor, torch.Tensor]]:
    """Yield (seeds, labels, latents) batches. `classes` defaults to class_for_seed; `cond_fn(seeds)` /
    `uncond_fn(seeds)` give per-sample conditioning of the two CFG branches; `guidance` draws each sample's
    routed tokens from its seed's generator; `stats` counts forward passes per branch."""
    net.eval()
    seeds = list(seeds)
    guidance = guidance if guidance is not None else Guidance()
    denoise = guidance.denoiser(net, num_classes, stats)
    for i in range(0, len(seeds), batch_size):
        batch = seeds[i:i + batch_size]
        gen = StackedRandomGenerator(device, batch)
        noise = gen.randn([len(batch), *shape], device=device)
        labels = batch_labels(batch, i, num_classes, classes, device, gen if class_labels == "random" else None)
        cond = {k: v.to(device) for k, v in cond_fn(batch).items()} if cond_fn is not None else None
        if uncond_fn is not None and guidance.guides:   # rides along; guidance.split_uncond takes it
            cond = {**(cond or {}), UNCOND: {k: v.to(device) for k, v in uncond_fn(batch).items()}}
        with per_sample_routing(net, batch, device, guidance):
            x = diffusion.sample(denoise, noise, labels, num_steps=num_steps, randn_like=gen.randn_like, cond=cond)
        yield batch, labels, given_frames(net, x, cond)


def given_frames(net, x: torch.Tensor, cond: Optional[dict]) -> torch.Tensor:
    """A model.i2v model's samples ("frames" mode) with their conditioning frames put back after the last step, as the
    image-to-video pipelines do (tread/models/families/first_frame.py); x unchanged otherwise."""
    if not cond or cond.get(FIRST_FRAME) is None:      # no conditioning frames: nothing to put back
        return x
    use = conditioned(cond, x.shape[0], x.device) if backbone(net).i2v_frames else None
    return x if use is None else restore_frames(x, cond[FIRST_FRAME], use)


def text_conditioning_for_seeds(dataset, net) -> Optional[CondFn]:
    """Sample seed i with the text embeddings (and Kontext reference latents) of dataset item i mod N; None for
    class-conditional data or models."""
    if not has_model_conditioning(dataset.conditioning or {}):
        return None
    if not backbone(net).text_conditioned:  # DiT: class labels only
        return None

    def cond(seeds: list[int]) -> dict:
        batch = dataset.__getitems__([s % len(dataset) for s in seeds])
        return {k: v for k, v in batch[2].items() if k in COND_KEYS}
    return cond
