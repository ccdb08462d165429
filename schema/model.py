"""The `routing`, `model`, `diffusion` and `optimizer` sections of the training config."""
from __future__ import annotations

from typing import Any, Literal, Optional

from models.dit import DIT_ARCHS
from models.families import FAMILIES
from models.lora import LORA_KEYS
from routing import SELECTION_MODES
from schema.base import SEED_LIMIT, ConfigError, Flag, NonNegativeNumber, Number, PositiveNumber, Section, key, one_of


class Selection(Section):
    """routing.selection"""

    mode: Literal[SELECTION_MODES] = key(one_of(SELECTION_MODES))
    importance_weight: Number = key("a number in [0, 1] (0 = uniform random, 1 = pure L1-norm importance)",
                                    ge=0, le=1)


class RouteSpec(Section):
    """one route"""

    selection_ratio: Number = key("a number in [0, 1): the fraction of tokens dropped (0.5 keeps half)", ge=0, lt=1)
    start_layer_idx: int = key("a block index (negative counts from the end)")
    end_layer_idx: int = key("a block index (negative counts from the end; inclusive)")


class Routing(Section):
    """the routing group (configs/routing/*.yaml); routes are checked against the model's depth when it is built"""

    enabled: Flag
    seed: int = key("an integer in [0, 2**32) (the router's generator seed; each process adds its rank)", ge=0,
                    lt=SEED_LIMIT)
    fp32_after_route: Flag
    selection: Selection = key("a mapping {mode, importance_weight}")
    routes: list[RouteSpec] = key("a list of {selection_ratio, start_layer_idx, end_layer_idx}")


class Lora(Section):
    """model.lora"""

    rank: int = key("a positive integer (adapter rank, e.g. 16)", ge=1)
    alpha: Optional[Number] = key("a number > 0 (scale = alpha / rank; null: rank)", gt=0, default=None)
    target_modules: list[str] = key("a non-empty list of module names to adapt, e.g. [to_q, to_k, to_v, to_out.0]",
                                    min_length=1)
    dropout: Number = key("a number in [0, 1)", ge=0, lt=1, default=0.0)
    init: Any = key("peft's init_lora_weights (true, gaussian, ...)", default=True)


assert set(Lora.model_fields) == set(LORA_KEYS)


class Backbone(Section):
    """what every model config has: the data's latent size and classes, gradient checkpointing, routing"""

    convert: Literal["all"] = key("all", alias="_convert_")
    input_size: int = key("a positive integer (latent side, from data.resolution)", ge=1)
    in_channels: int = key("a positive integer (latent channels, from data.channels)", ge=1)
    num_classes: int = key("an integer >= 0 (from data.num_classes; 0: text conditioning only)", ge=0)
    gradient_checkpointing: Flag
    routing: Routing = key("the routing group")


class DiTModel(Backbone):
    """model=dit|tread"""

    target: Literal["models.build_dit"] = key("models.build_dit", alias="_target_")
    arch: Literal[tuple(DIT_ARCHS)] = key(one_of(DIT_ARCHS))
    # DiT arguments a research run may override (+model.depth=6, ...)
    depth: Optional[int] = key("an integer >= 1", ge=1, default=None)
    hidden_size: Optional[int] = key("an integer >= 1", ge=1, default=None)
    num_heads: Optional[int] = key("an integer >= 1", ge=1, default=None)
    mlp_ratio: Optional[Number] = key("a number > 0", gt=0, default=None)


FAMILY_ONLY = {"guidance": "flux", "frames": "wan", "expand_timesteps": "wan", "vae_scale_factor": "pixart"}


class FamilyModel(Backbone):
    """model=flux|sd3|wan|auraflow|pixart"""

    target: Literal["models.families.build_family"] = key("models.families.build_family", alias="_target_")
    family: Literal[FAMILIES] = key(one_of(FAMILIES))
    preset: str = key("a preset name of the family (tiny, mid, ...)")
    pretrained: Optional[str] = key("null or a hub id / local diffusers folder")
    subfolder: Optional[str] = key("null or the transformer's folder inside model.pretrained")
    config: Optional[dict[str, Any]] = key("null or a mapping of diffusers config overrides")
    arch: str = key("a display name")
    text_len: int = key("a positive integer (class-to-text table length)", ge=1)
    lora: Optional[Lora] = key("null or {rank, alpha, target_modules, dropout}")
    guidance: Optional[Number] = key("null or a number (FLUX guidance-distilled models)", default=None)
    frames: Optional[int] = key("a positive integer (Wan latent frames)", ge=1, default=None)
    expand_timesteps: Optional[bool] = key("true or false (Wan)", default=None)
    vae_scale_factor: Optional[int] = key("a positive integer (PixArt)", ge=1, default=None)

    def check_family_keys(self) -> None:
        for name, family in FAMILY_ONLY.items():
            if name in self.model_fields_set and family != self.family:
                raise ConfigError(f"model.{name} is a {family} key; model.family={self.family} does not take it.")


MODELS = {"models.build_dit": DiTModel, "models.families.build_family": FamilyModel}


class EDMConfig(Section):
    """diffusion=edm"""

    target: Literal["diffusion.EDM"] = key("diffusion.EDM", alias="_target_")
    sigma_data: Number = key("a number > 0 (std of the data)", gt=0)
    P_mean: Number = key("a number (mean of ln sigma in training)")
    P_std: PositiveNumber
    num_steps: int = key("an integer >= 1 (Heun steps)", ge=1)
    sigma_min: PositiveNumber
    sigma_max: Number = key("a number > sigma_min", gt=0)
    rho: PositiveNumber
    S_churn: NonNegativeNumber
    S_min: NonNegativeNumber
    S_max: float = key("a number >= S_min (.inf allowed)", ge=0)
    S_noise: NonNegativeNumber

    def check_range(self) -> None:
        if not self.sigma_min < self.sigma_max:
            raise ConfigError(f"diffusion.sigma_min={self.sigma_min} and diffusion.sigma_max={self.sigma_max} are not "
                              f"allowed; allowed: 0 < sigma_min < sigma_max.")


class RFConfig(Section):
    """diffusion=rf"""

    target: Literal["diffusion.RectifiedFlow"] = key("diffusion.RectifiedFlow", alias="_target_")
    P_mean: Number = key("a number (mean of logit t)")
    P_std: PositiveNumber
    shift: Number = key("a number > 0 (timestep shift)", gt=0)
    t_scale: Number = key("a number > 0 (noise level = t * t_scale)", gt=0)
    num_steps: int = key("an integer >= 1 (Euler steps)", ge=1)


DIFFUSIONS = {"diffusion.EDM": EDMConfig, "diffusion.RectifiedFlow": RFConfig}


class AdamW(Section):
    """optimizer=adamw"""

    target: Literal["torch.optim.AdamW"] = key("torch.optim.AdamW", alias="_target_")
    partial: Literal[True] = key("true", alias="_partial_")
    lr: PositiveNumber
    betas: list[Number] = key("[beta1, beta2], each in [0, 1)", min_length=2, max_length=2)
    weight_decay: NonNegativeNumber
    eps: PositiveNumber
    fused: Optional[bool] = key("true, false or null (torch's default implementation)")

    def check_betas(self) -> None:
        if not all(0 <= b < 1 for b in self.betas):
            raise ConfigError(f"optimizer.betas={list(self.betas)} is not allowed; allowed: [beta1, beta2], each in "
                              f"[0, 1).")


OPTIMIZERS = {"torch.optim.AdamW": AdamW}
