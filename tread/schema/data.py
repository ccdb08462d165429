"""The `data` section: the project's latent directory format (optionally a built-in dataset) or WebDataset
shards. data.channels / resolution / num_classes are what the model expects; the dataset is checked
against them when it is opened."""
from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import model_validator

from tread.data.meta import LATENT_KINDS
from tread.data.wds import LATENT_DRAWS
from tread.encoders.text_families import TEXT_FAMILIES
from tread.models.dit import DIT_ARCHS
from tread.schema.base import SEED_LIMIT, ConfigError, Flag, Number, Section, check, key, one_of


class ToyArgs(Section):
    """data.builtin_args of the toy_shapes data"""

    num_per_class: int = key("a positive integer (images per class)", ge=1)
    resolution: int = key("an integer >= 4 (image side)", ge=4)
    seed: int = key("an integer in [0, 2**32) (generator seed)", ge=0, lt=SEED_LIMIT)
    loss_masks: bool = key("true or false (store each shape's coverage as a loss mask)", default=False)


class ToyTextArgs(Section):
    """data.builtin_args of the toy_shapes_text data (data=toy_text)"""

    num_per_class: int = key("a positive integer (images per class)", ge=1)
    resolution: int = key("an integer >= 4 (image side)", ge=4)
    seed: int = key("an integer in [0, 2**32) (generator seed)", ge=0, lt=SEED_LIMIT)
    family: Literal[TEXT_FAMILIES] = key(one_of(TEXT_FAMILIES) + " (whose text encoders encode the captions)")
    text_encoders: Optional[str] = key("a local pipeline folder with the family's text_encoder*/ and tokenizer*/ "
                                       "(scripts/tiny_text_encoders.py writes tiny random ones)")
    caption: str = key("a caption template containing {class}, e.g. 'a {class}'")
    max_text_length: int = key("a positive integer (text tokens per caption)", ge=1)


class ToyBucketsArgs(Section):
    """data.builtin_args of the bucketed toy_shapes data (data=toy_buckets)"""

    sizes: list[str] = key("a list of image sizes WIDTHxHEIGHT (one bucket each)", min_length=1)
    num_per_class: Union[int, list[int]] = key("images per class: an integer >= 1 for every bucket, or one per size")
    loss_masks: bool = key("true or false (store each shape's coverage as a loss mask)", default=False)
    seed: int = key("an integer in [0, 2**32) (generator seed)", ge=0, lt=SEED_LIMIT)


class ToyClipsArgs(Section):
    """data.builtin_args of the moving toy shapes (data=toy_clips)"""

    num_per_class: int = key("a positive integer (clips per class)", ge=1)
    frames: int = key("a positive integer (frames per clip)", ge=1)
    resolution: int = key("an integer >= 4 (frame side)", ge=4)
    seed: int = key("an integer in [0, 2**32) (generator seed)", ge=0, lt=SEED_LIMIT)
    first_frame: bool = key("true or false (also store each clip's first frame as first_frame_latents)",
                            default=False)


BUILTIN_ARGS = {"toy_shapes": ToyArgs, "toy_shapes_text": ToyTextArgs, "toy_shapes_buckets": ToyBucketsArgs,
                "toy_shapes_clips": ToyClipsArgs}


class ResolutionPhase(Section):
    """one phase of data.resolution_schedule (bucketed data)"""

    until_step: Optional[int] = key("null (the last phase: to the end) or the step this phase ends before, above "
                                    "the previous phase's", ge=1)
    min_pixels: Optional[int] = key("null or the smallest bucket area (width x height in pixels) drawn", ge=1,
                                    default=None)
    max_pixels: Optional[int] = key("null or the largest bucket area (width x height in pixels) drawn", ge=1,
                                    default=None)


class DataCommon(Section):
    """keys of every data config"""

    channels: int = key("a positive integer (latent channels the model expects)", ge=1)
    resolution: int = key("a positive integer (latent side the model expects)", ge=1)
    frames: int = key("a positive integer (latent frames T of the model's default grid; 1 = images; video data of "
                      "one shape must have this many)", ge=1, default=1)
    num_classes: int = key("a positive integer (labels lie in [0, num_classes))", ge=1)
    dit_arch: Optional[Literal[tuple(DIT_ARCHS)]] = key(f"null or {one_of(DIT_ARCHS)} (model=dit/tread's default "
                                                        f"size for this data)", default=None)
    resolution_schedule: Optional[list[ResolutionPhase]] = key(
        "null or a list of phases {until_step, min_pixels, max_pixels} for bucketed data (e.g. small buckets first, "
        "then large ones)", default=None, min_length=1)
    latent_draw: Literal[LATENT_DRAWS] = key(one_of(LATENT_DRAWS) + " (sample: moments give a posterior draw per "
                                             "read; mean: the posterior mean; stored: the array as stored, the "
                                             "paper code's)", default="sample")
    allow_nonfinite: Flag = key("false (a dataset holding NaN/inf is refused at start-up, naming the file and the "
                                "first sample) or true (train anyway with a warning: train.nonfinite skips each step "
                                "such a sample spoils)")


class LatentsData(DataCommon):
    """data.format=latents (our directory format)"""

    format: Literal["latents"] = key("latents or wds")
    path: str = key("a directory with meta.json, latents.npy, labels.npy (or where the built-in data is made)")
    builtin: Optional[Literal[tuple(BUILTIN_ARGS)]] = key(f"null (use data.path as is) or {one_of(BUILTIN_ARGS)}")
    builtin_args: Optional[dict[str, Any]] = key("null or the built-in generator's arguments", default=None)

    def check(self) -> None:
        if self.latent_draw == "mean":
            raise ConfigError("data.latent_draw=mean is not allowed with data.format=latents (our directory format "
                              "draws moments per read); allowed: sample (moments: a posterior draw; plain latents: as "
                              "stored) or stored (plain latents as stored); mean: data.format=wds shards of moments.")
        if self.builtin is None:
            return
        if self.builtin_args is None:
            raise ConfigError(f"data.builtin={self.builtin} needs data.builtin_args ({{num_per_class, resolution, "
                              f"seed, ...}}).")
        check(BUILTIN_ARGS[self.builtin], self.builtin_args, "data.builtin_args")


class WdsData(DataCommon):
    """data.format=wds (WebDataset tar shards of VAE latents, the paper repo's layout)"""

    format: Literal["wds"] = key("latents or wds")
    path: Union[str, list[str]] = key("a directory of .tar shards, one .tar, a brace pattern or a list of them")
    builtin: Optional[Literal[None]] = key("null (built-in data uses the 'latents' format)", default=None)
    latent_scale: Number = key("a number > 0 (multiplies each drawn latent)", gt=0)
    latent_kind: Literal[LATENT_KINDS] = key(one_of(LATENT_KINDS))
    vae: str = key("the VAE that decodes the latents (hub id or local path)")
    index_dir: Optional[str] = key("null (paths.cache_dir/wds_index) or a directory for the shard index cache")

    @model_validator(mode="after")
    def check_draw(self) -> "WdsData":
        """latent_draw=mean needs moments (the shapes are checked when the shards are opened)."""
        if self.latent_draw == "mean" and self.latent_kind != "moments":
            raise ConfigError(f"data.latent_draw=mean needs moments data (data.latent_kind=moments, got "
                              f"{self.latent_kind}); allowed with data.latent_kind={self.latent_kind}: "
                              f"data.latent_draw=sample or stored")
        return self


DATA = {"latents": LatentsData, "wds": WdsData}
