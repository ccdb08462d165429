"""The contract every trained backbone implements (DiT, SPRINT and each diffusers family): what training,
sampling, evaluation and the planner may ask of a model. The defaults are a class-conditioned image model's."""
from __future__ import annotations

import contextlib
from typing import Any, ClassVar, Iterator, Mapping, Optional

from tread.models.errors import ModelConfigError
from tread.routing import RoutedBackbone

# model= configs whose sequence can split over a context group (train.context_parallel, docs/scaling.md): DiT's
# own attention, the families whose text reaches the image tokens by cross-attention (whole on every process of the
# group) and those that attend text and image jointly (the text split with them).
CONTEXT_PARALLEL_MODELS = ("dit", "tread", "wan", "ltx_video", "cosmos", "hunyuan_video", "flux", "flux2",
                           "qwen_image")


class Backbone(RoutedBackbone):
    """A routed backbone: (x, noise_level, labels, **cond) -> prediction, with these capabilities."""

    text_conditioned: ClassVar[bool] = False   # its conditioning is text (cond["text"], ...); else class labels only
    frames_axis: ClassVar[bool] = False        # inputs are (B, C, T, H, W) (video); images get T = 1
    frames: int = 1                            # latent frames of the default grid (model.frames; 1: images)
    i2v: bool = False                          # model.i2v: clips conditioned on their first frame
    kontext: bool = False                      # model.kontext: never-routed reference latents beside the target
    arch: str = ""                             # the display name (model.arch)
    analytic_flops: ClassVar[bool] = False     # forward_flops(routes, grid) counts analytically (DiT); else counted
    span: Optional[tuple[int, int]] = None     # SPRINT: the deep span path-drop guidance skips; None: no such path
    path_drop_prob: Optional[float] = None     # SPRINT: the training probability of dropping the deep path
    input_size: int                            # the default latent side (data.resolution)

    @contextlib.contextmanager
    def shape_only(self) -> Iterator[None]:
        """Around a FLOPs count on the meta device: what makes the forward computable without values."""
        yield

    def forward_flops(self, routes: Any = None, grid: Any = None) -> float:
        """Forward FLOPs per sample, analytically (where analytic_flops)."""
        raise NotImplementedError

    @property
    def i2v_frames(self) -> bool:
        """Whether given first frames replace the noisy ones (and are left out of the loss)."""
        return False

    def latent_patch(self) -> tuple[int, int, int]:
        """(pt, ph, pw): latent cells per token along T, H, W."""
        raise NotImplementedError

    def check_size(self, height: int, width: int, frames: int = 1) -> None:
        """Raise a one-line UserError for latents this backbone cannot take (called per bucket before training)."""

    def check_text_data(self, conditioning: Mapping[str, Any], where: str) -> None:
        """Raise a one-line UserError when the data's text conditioning does not fit (class models ignore text)."""

    def attention_width(self) -> int:
        """heads x head dim of the blocks' attention: what an all-to-all of context parallelism moves per token."""
        raise NotImplementedError

    def use_context_parallel(self, split: Any) -> None:
        """Run on this process's shard of every sequence of a context group (`split`: a ContextParallel), with
        attention across the group; backbones that can implement it, the rest refuse in one line."""
        raise ModelConfigError(f"train.context_parallel.degree={split.degree}: model {self.arch or type(self).__name__} "
                               f"cannot split its sequence over processes; allowed: train.context_parallel.degree=1, "
                               f"or model={' | '.join(CONTEXT_PARALLEL_MODELS)}.")

    def repa_flops(self, routes: Any = None, grid: Any = None) -> float:
        """Forward FLOPs per sample of an alignment head (REPA; none by default)."""
        return 0.0
