"""The `routing`, `model`, `diffusion` and `optimizer` sections of the training config."""
from __future__ import annotations

import re
from typing import Any, Literal, Optional, Union

from pydantic import model_validator

from tread.diffusion.rf import DynamicShift, RectifiedFlow
from tread.encoders.patch import ENCODERS as REPA_ENCODERS
from tread.models.dit import DIT_ARCHS, parse_arch
from tread.models.families import FAMILIES, family_module
from tread.models.lora import ADAPTER_TYPES, LORA_KEYS, check_type_keys
from tread.models.quantize import BASE_DTYPES, QUANTIZE_MODES, check_base_dtype, check_quantize
from tread.models.repa import check_repa_block, resolve_repa_block
from tread.models.sprint import sprint_span
from tread.routing import SELECTION_MODES
from tread.schema.base import (SEED_LIMIT, ConfigError, Flag, NonNegativeNumber, Number, PositiveNumber, Section, key,
                               one_of, show)


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


class PhaseTrain(Section):
    """routing.schedule[i].train: training hyperparameters from the phase's start on (unset: the config's)"""

    lr: Optional[Number] = key("a number > 0 (the phase's optimizer lr; its lr schedule restarts at the phase)",
                               gt=0, default=None)
    batch_size: Optional[int] = key("an integer >= 1 (the phase's global batch, over processes and accumulation)",
                                    ge=1, default=None)
    warmup_steps: Optional[int] = key("an integer >= 0 (lr warm-up steps from the phase's start; 0: none)", ge=0,
                                      default=None)
    grad_clip: Optional[Number] = key("a max gradient norm > 0", gt=0, default=None)


class Phase(Section):
    """one phase of routing.schedule"""

    start_step: int = key("an integer >= 0 (the phase's first training step; the first phase starts at 0)", ge=0)
    selection_ratio: Optional[Any] = key("null (routing.routes as configured), a ratio in [0, 1) over routing.routes' "
                                         "spans, or [from, to]: a linear ramp until the next phase", default=None)
    routes: Optional[list[RouteSpec]] = key("null or a list of {selection_ratio, start_layer_idx, end_layer_idx} "
                                            "([] trains dense)", default=None)
    train: Optional[PhaseTrain] = key("null or {lr, batch_size, warmup_steps, grad_clip} (any of them)", default=None)
    path_drop_prob: Optional[Number] = key("null (model.sprint.path_drop_prob) or a number in [0, 1) (model=sprint "
                                           "only)", ge=0, lt=1, default=None)


class Routing(Section):
    """the routing group (configs/routing/*.yaml); routes are checked against the model's depth when it is built"""

    enabled: Flag
    seed: int = key("an integer in [0, 2**32) (the router's generator seed; each process adds its rank)", ge=0,
                    lt=SEED_LIMIT)
    fp32_after_route: Flag
    selection: Selection = key("a mapping {mode, importance_weight}")
    routes: list[RouteSpec] = key("a list of {selection_ratio, start_layer_idx, end_layer_idx}")
    schedule: Optional[list[Phase]] = key("null or a list of phases {start_step, selection_ratio | routes, "
                                          "train: {lr, batch_size, warmup_steps, grad_clip}, path_drop_prob} "
                                          "(docs/routes.md, 'Routing schedules')", default=None)


class Lora(Section):
    """model.lora"""

    type: Literal[ADAPTER_TYPES] = key(one_of(ADAPTER_TYPES) + " (peft's LoraConfig, LoKrConfig, LoHaConfig)",
                                       default="lora")
    rank: int = key("a positive integer (adapter rank, e.g. 16; peft's r)", ge=1)
    alpha: Optional[Number] = key("a number > 0 (scale = alpha / rank; null: rank)", gt=0, default=None)
    target_modules: list[str] = key("a non-empty list of module names to adapt, e.g. [to_q, to_k, to_v, to_out.0]",
                                    min_length=1)
    init: Any = key("peft's init_lora_weights (lora: true, false, gaussian, ...) or init_weights (lokr: true, "
                    "false, lycoris; loha: true, false)", default=True)
    dropout: Number = key("a number in [0, 1) (type=lora only: dropout on the adapter's input)", ge=0, lt=1,
                          default=0.0)
    decompose_factor: int = key("-1 (near-square Kronecker factors) or an integer >= 1 (type=lokr only)", ge=-1,
                                default=-1)
    decompose_both: bool = key("true or false (type=lokr only: also split the first Kronecker factor into a rank "
                               "product)", default=False)
    rank_dropout: Number = key("a number in [0, 1) (type=lokr|loha only: drops rows of the update)", ge=0, lt=1,
                               default=0.0)
    module_dropout: Number = key("a number in [0, 1) (type=lokr|loha only: skips the whole adapter)", ge=0, lt=1,
                                 default=0.0)

    @model_validator(mode="after")
    def check_adapter_keys(self) -> "Lora":
        """Keys of another adapter type are an error (tread/models/lora.py says which type takes which)."""
        check_type_keys(self.model_fields_set, self.type, "model.lora")
        if self.decompose_factor == 0:
            raise ValueError("model.lora.decompose_factor=0 is not allowed; allowed: -1 (near-square Kronecker "
                             "factors) or an integer >= 1.")
        return self


assert set(Lora.model_fields) == set(LORA_KEYS)


class Repa(Section):
    """model.repa (configs/repa/*.yaml)"""

    weight: PositiveNumber
    block: Optional[int] = key("null (REPA's published block for the model's depth) or a block index of the model "
                               "(negative counts from the end)", default=None)
    encoder: Literal[REPA_ENCODERS] = key(one_of(REPA_ENCODERS))
    encoder_weights: Optional[str] = key("null (toy, toy_random, toy_fid) or a local transformers Dinov2Model folder "
                                         "(dinov2)",
                                         default=None)
    encoder_dim: Optional[int] = key("null (read from the encoder) or the encoder's feature width", ge=1,
                                     default=None)
    projector_dim: int = key("a positive integer (hidden width of the projection MLP)", ge=1, default=2048)
    targets: Literal["auto", "precomputed", "decoded"] = key(
        "auto (the features the data stores when this encoder made them, else decoded), precomputed (the stored "
        "features, required) or decoded (encode the decoded latents each step)", default="auto")


class Backbone(Section):
    """what every model config has: the data's latent size and classes, gradient checkpointing, routing"""

    convert: Literal["all"] = key("all", alias="_convert_")
    input_size: int = key("a positive integer (latent side, from data.resolution)", ge=1)
    in_channels: int = key("a positive integer (latent channels, from data.channels)", ge=1)
    num_classes: int = key("an integer >= 0 (from data.num_classes; 0: text conditioning only)", ge=0)
    gradient_checkpointing: Flag
    routing: Routing = key("the routing group")


class Sprint(Section):
    """model.sprint (model=sprint)"""

    start: int = key("a block index: the deep span's first block (dense blocks come before it)")
    end: int = key("a block index: the deep span's last block, inclusive (dense blocks come after it)")
    path_drop_prob: Number = key("a number in [0, 1): per-sample probability, in training, of dropping the whole "
                                 "deep path (path-drop guidance learns from it)", ge=0, lt=1, default=0.1)


SPRINT_TARGET = "tread.models.build_sprint"


class DiTModel(Backbone):
    """model=dit|tread|sprint"""

    target: Literal["tread.models.build_dit", "tread.models.build_sprint"] = key(
        "tread.models.build_dit or tread.models.build_sprint", alias="_target_")
    sprint: Optional[Sprint] = key("{start, end, path_drop_prob} (model=sprint, tread.models.build_sprint, only)",
                                   default=None)
    init: Literal["adaln_zero", "paper"] = key("adaln_zero (DiT's adaLN-Zero) or paper (CompVis/tread's code: "
                                               "Xavier-uniform over the zeroed adaLN and final layers)",
                                               default="adaln_zero")
    arch: Literal[tuple(DIT_ARCHS)] = key(one_of(DIT_ARCHS))
    repa: Optional[Repa] = key("null or {weight, block, encoder, encoder_weights, encoder_dim, projector_dim, "
                               "targets} (repa=toy|toy_random|toy_fid|dinov2)", default=None)
    # DiT arguments a research run may override (+model.depth=6, ...); null: model.arch's. The rules between them
    # (divisibility) are check_geometry's.
    depth: Optional[int] = key("an integer in [1, 128] (transformer blocks)", ge=1, le=128, default=None)
    hidden_size: Optional[int] = key("a multiple of 4 in [8, 16384] (token width; the 2-D sin-cos position "
                                     "embedding splits it in four)", ge=8, le=16384, default=None)
    num_heads: Optional[int] = key("an integer in [1, 256] dividing the hidden size (attention heads)", ge=1, le=256,
                                   default=None)
    patch_size: Optional[int] = key("an integer in [1, 16] dividing model.input_size (latent cells per token side)",
                                    ge=1, le=16, default=None)
    mlp_ratio: Optional[Number] = key("a number in [0.25, 16] (MLP width = mlp_ratio x hidden size; DiT: 4)",
                                      ge=0.25, le=16, default=None)

    # The keys only the families have, as a DiT has them (not config keys): every model section reads alike.
    family = property(lambda self: None)
    quantize = property(lambda self: None)
    base_dtype = property(lambda self: "fp32")
    i2v = property(lambda self: None)
    lora = property(lambda self: None)
    preset = property(lambda self: None)
    text_encoders = property(lambda self: None)

    @model_validator(mode="after")
    def check_model(self) -> "DiTModel":
        """The overrides fit together, model.sprint belongs to model=sprint, and REPA's block and SPRINT's span lie
        in the model (checked here, before anything is built)."""
        depth = check_geometry(self)
        check_sprint_key(self, depth)
        if self.repa is not None:
            check_repa_block(resolve_repa_block(self.repa.block, depth), depth)
        return self


def check_geometry(m: DiTModel) -> int:
    """The DiT's block count; hidden size, heads and patch (overridden or model.arch's) that DiT cannot build
    are refused naming the key."""
    depth, *named = parse_arch(m.arch)
    values, shown = {}, {}
    for name, arch_value in zip(("hidden_size", "num_heads", "patch_size"), named):
        given = getattr(m, name)
        values[name] = arch_value if given is None else given
        shown[name] = f"model.{name}={values[name]}" + ("" if given is not None else f" ({m.arch}'s)")
    hidden, heads, patch = values.values()
    if hidden % heads:
        raise ValueError(f"{shown['num_heads']} does not divide {shown['hidden_size']}; allowed: a number of heads "
                         f"dividing the hidden size (each head gets hidden_size / num_heads channels).")
    if hidden % 4:
        raise ValueError(f"{shown['hidden_size']} is not allowed; allowed: a multiple of 4 (the 2-D sin-cos position "
                         f"embedding splits the width in four).")
    if m.input_size % patch:
        raise ValueError(f"{shown['patch_size']} does not divide model.input_size={m.input_size} (data.resolution); "
                         f"allowed: a patch size dividing the latent side.")
    return depth if m.depth is None else m.depth


def check_sprint_key(m: DiTModel, depth: int) -> None:
    """model.sprint is model=sprint's (tread.models.build_sprint): needed there, refused elsewhere; its span lies
    in the model."""
    if m.target != SPRINT_TARGET and m.sprint is not None:
        raise ValueError(f"model.sprint={show(m.sprint.model_dump(exclude_unset=True))} is a key of model=sprint "
                         f"(model._target_={SPRINT_TARGET}); model._target_={m.target} does not take it. Allowed: "
                         f"model=sprint, or no model.sprint.")
    if m.target == SPRINT_TARGET:
        if m.sprint is None:
            raise ValueError(f"model.sprint is missing; model._target_={SPRINT_TARGET} needs model.sprint={{start, "
                             f"end, path_drop_prob}} (configs/model/sprint.yaml).")
        sprint_span(m.sprint.model_dump(), depth)


# model keys only some families take: key -> those families (a family module adds itself where it takes one).
FAMILY_ONLY = {"guidance": ("flux", "sana", "flux2"), "kontext": ("flux", "flux2", "qwen_image"), "use_t5": ("sd3",),
               "frames": ("wan", "ltx_video", "cosmos", "hunyuan_video"), "frame_rate": ("ltx_video", "cosmos"),
               "expand_timesteps": ("wan", "ltx_video", "cosmos"), "i2v": ("wan", "ltx_video", "hunyuan_video"), "vae_scale_factor": ("pixart",)}
# the 2026-12 wave: one line per family and key, e.g. FAMILY_ONLY["frames"] += ("wan_vace",)
FAMILY_ONLY["frames"] += ("kandinsky5",)
FAMILY_ONLY["frames"] += ("ltx2",)
FAMILY_ONLY["frame_rate"] += ("ltx2",)
FAMILY_ONLY["expand_timesteps"] += ("ltx2",)
FAMILY_ONLY["i2v"] += ("cosmos",)          # Video2World conditioning frames (cosmos.py)
FAMILY_ONLY["frames"] += ("minimax_h3",)
FAMILY_ONLY["kontext"] += ("flux3",)       # FLUX.3 image-to-image references (flux3.py)
FAMILY_ONLY["frames"] += ("wan_vace",)
FAMILY_ONLY["conditioning_scale"] = ("wan_vace",)   # WanVACEPipeline's weight of each VACE hint (wan_vace.py)
# -- new family keys above this line --


class FamilyModel(Backbone):
    """model=flux|sd3|wan|auraflow|pixart"""

    target: Literal["tread.models.families.build_family"] = key("tread.models.families.build_family", alias="_target_")
    family: Literal[FAMILIES] = key(one_of(FAMILIES))
    preset: str = key("a preset name of the family (tiny, mid, ...)")
    pretrained: Optional[str] = key("null or a hub id / local diffusers folder")
    subfolder: Optional[str] = key("null or the transformer's folder inside model.pretrained")
    config: Optional[dict[str, Any]] = key("null or a mapping of diffusers config overrides")
    arch: str = key("a display name")
    text_len: int = key("a positive integer (class-to-text table length)", ge=1)
    lora: Optional[Lora] = key("null or {type, rank, alpha, target_modules, ...} (lora | lokr | loha)")
    quantize: Optional[Literal[QUANTIZE_MODES]] = key(
        "null (full precision) or " + one_of(QUANTIZE_MODES) + ": the frozen base blocks' Linear weights are "
        "quantized and model.lora's adapters train on top (needs model.lora; tread/models/quantize.py)", default=None)
    base_dtype: Literal[BASE_DTYPES] = key(
        one_of(BASE_DTYPES) + ": how an adapter run stores its frozen Linear weights (bf16: half of fp32; fp8: the "
        "blocks' in float8 with per-row scales; needs model.lora; tread/models/quantize.py)", default="fp32")
    text_encoders: Optional[str] = key("null or a local diffusers pipeline folder with the family's text_encoder*/ "
                                       "and tokenizer*/ subfolders (prompts: sample.py, eval.validation_prompts)",
                                       default=None)
    guidance: Optional[Number] = key("null or a number (FLUX / Sana-Sprint guidance-distilled models)", default=None)
    kontext: bool = key("true or false (FLUX Kontext, FLUX.2 and Qwen-Image-Edit: the data's reference latents, "
                        "reference_latents.npy, condition every sample as never-routed image tokens)", default=False)
    use_t5: bool = key("true or false (SD3: false zeroes the T5 part of the text embeddings, the positions after "
                       "the 77 CLIP tokens, as StableDiffusion3Pipeline with text_encoder_3=None)", default=True)
    frames: Optional[int] = key("a positive integer (video families: latent frames)", ge=1, default=None)
    frame_rate: Optional[Number] = key("a number > 0 (LTX-Video, Cosmos: frames per second, RoPE's temporal scale)",
                                       gt=0, default=None)
    expand_timesteps: Optional[bool] = key("true or false (Wan, LTX-Video: per-token (B, N) timesteps; Cosmos: "
                                           "per-frame (B, T))", default=None)
    i2v: Optional[bool] = key("true or false (video families with per-token timesteps: the data's first-frame latents, "
                              "first_frame_latents.npy, condition the clip as the image-to-video pipelines do)",
                              default=None)
    vae_scale_factor: Optional[int] = key("a positive integer (PixArt)", ge=1, default=None)
    conditioning_scale: Optional[Union[Number, list[Number]]] = key(
        "a number, or a list of one number per VACE layer (WanVACE: WanVACEPipeline's conditioning_scale, the weight "
        "of each VACE hint; 1.0 trains as the pipeline samples by default)", default=None)

    repa: Optional[Any] = key("null (REPA, repa=toy|toy_random|toy_fid|dinov2, is for DiT models: "
                              "model=dit|tread|sprint)", default=None)

    sprint = property(lambda self: None)      # model=sprint's key, as a family has it (not a config key)

    @model_validator(mode="after")
    def check_quantize(self) -> "FamilyModel":
        """A quantized base trains through adapters only (tread/models/quantize.py says it, once); REPA is DiT's."""
        check_quantize(self.quantize, self.lora)
        check_base_dtype(self.base_dtype, self.lora, self.quantize)
        if self.repa is not None:
            raise ValueError(f"model.repa is set (repa=...) but model.family={self.family}; REPA alignment is "
                             f"implemented for DiT models (model=dit|tread|sprint); allowed here: repa=null.")
        return self

    @model_validator(mode="after")
    def check_config(self) -> "FamilyModel":
        """model.config's geometry keys in their ranges and at least one block, before the routes are checked
        against the depth (a preset the family lacks, or model.pretrained, is the builder's to refuse)."""
        if self.config and not self.pretrained:
            check_family_config(self.family, self.preset, self.config)
        return self

    def check(self) -> None:
        for name, families in FAMILY_ONLY.items():
            if name in self.model_fields_set and self.family not in families:
                raise ConfigError(f"model.{name} is a key of model.family={' | '.join(families)}; "
                                  f"model.family={self.family} does not take it.")


# model.config keys of the families' diffusers configs (where a family has them) and their allowed ranges. Block
# counts are the preset keys named num_*layers or num_*blocks (LAYER_KEY), each in [0, 256] and together at least 1.
FAMILY_CONFIG_RANGES = {"num_attention_heads": (1, 256), "attention_head_dim": (1, 1024), "patch_size": (1, 16),
                        "mlp_ratio": (0.25, 16.0), "ffn_dim": (1, 1 << 16)}
LAYER_RANGE = (0, 256)
LAYER_KEY = re.compile(r"^n(?:um)?_\w*(?:layers|blocks)$")   # n_*layers: Z-Image; num_*_blocks: Kandinsky 5


def check_family_config(family: str, preset: str, config: dict[str, Any]) -> None:
    """model.config over the preset: each geometry key in its range (naming it), and the blocks not all gone."""
    presets = family_module(family).PRESETS
    if preset not in presets:
        return
    chosen = {**presets[preset], **config}
    layers = sorted(k for k, v in chosen.items() if LAYER_KEY.match(k) and isinstance(v, int))
    for name, value in config.items():
        bounds = LAYER_RANGE if name in layers or LAYER_KEY.match(name) else FAMILY_CONFIG_RANGES.get(name)
        if bounds is not None:
            _check_range(f"model.config.{name}", value, *bounds)
    if layers and sum(chosen[k] for k in layers) < 1:
        shown = " and ".join(f"model.config.{k}={chosen[k]}" for k in layers)
        raise ValueError(f"{shown} {'leaves' if len(layers) == 1 else 'leave'} the {family} transformer without "
                         f"blocks; allowed: at least one block "
                         f"({' + '.join(layers)} >= 1).")


def _check_range(name: str, value: Any, low: Any, high: Any) -> None:
    """A number (an integer where the bounds are integers), or a list of them (patch sizes per axis), in
    [low, high]."""
    items = list(value) if isinstance(value, (list, tuple)) else [value]
    kind = int if isinstance(low, int) else (int, float)
    if not items or not all(isinstance(v, kind) and not isinstance(v, bool) and low <= v <= high for v in items):
        what = "an integer" if kind is int else "a number"
        raise ValueError(f"{name}={show(value)} is not allowed; allowed: {what} in [{low}, {high}]"
                         f"{' (or a list of them, one per axis)' if name.endswith('patch_size') else ''}.")




class EDMConfig(Section):
    """diffusion=edm"""

    target: Literal["tread.diffusion.EDM"] = key("tread.diffusion.EDM", alias="_target_")
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
    min_snr_gamma: Optional[PositiveNumber] = key(
        "null (EDM's loss weight) or a number > 0: Min-SNR-gamma, min(SNR, gamma) / sigma_data^2 with SNR = "
        "sigma_data^2 / sigma^2 (Hang et al. 2023: 5)", default=None)

    def check(self) -> None:
        if not self.sigma_min < self.sigma_max:
            raise ConfigError(f"diffusion.sigma_min={self.sigma_min} and diffusion.sigma_max={self.sigma_max} are not "
                              f"allowed; allowed: 0 < sigma_min < sigma_max.")


class DynamicShiftConfig(Section):
    """diffusion.dynamic_shift"""

    base_shift: Number = key("a number (mu at base_seq_len image tokens; FLUX.1: 0.5)")
    max_shift: Number = key("a number (mu at max_seq_len image tokens; FLUX.1: 1.15)")
    base_seq_len: int = key("an integer >= 1, below max_seq_len (FLUX.1: 256)", ge=1)
    max_seq_len: int = key("an integer above base_seq_len (FLUX.1: 4096)", ge=2)
    patch_size: int = key("an integer >= 1: latent cells per token side (FLUX packs 2x2: 2; DiT, SD3: their "
                          "patch_size)", ge=1)

    @model_validator(mode="after")
    def check_lengths(self) -> "DynamicShiftConfig":
        DynamicShift(**self.model_dump())       # base_seq_len < max_seq_len, said once (tread/diffusion/rf.py)
        return self


class RFConfig(Section):
    """diffusion=rf"""

    target: Literal["tread.diffusion.RectifiedFlow"] = key("tread.diffusion.RectifiedFlow", alias="_target_")
    P_mean: Number = key("a number (mean of logit t; weighting_scheme=logit_normal)")
    P_std: PositiveNumber = key("a number > 0 (std of logit t; weighting_scheme=logit_normal)")
    shift: Number = key("a number > 0 (static timestep shift; 1 when dynamic_shift is set)", gt=0)
    t_scale: Number = key("a number > 0 (noise level = t * t_scale)", gt=0)
    num_steps: int = key("an integer >= 1 (Euler steps)", ge=1)
    dynamic_shift: Optional[DynamicShiftConfig] = key(
        "null (the static shift) or {base_shift, max_shift, base_seq_len, max_seq_len, patch_size}: FLUX's "
        "resolution-dependent shift exp(mu), mu linear in the image token count", default=None)
    weighting_scheme: Literal["logit_normal", "mode", "cosmap", "sigma_sqrt", "uniform"] = key(
        "diffusers' --weighting_scheme (uniform is its none): logit_normal (t = sigmoid(N(P_mean, P_std))), mode "
        "(SD3's mode sampling, mode_scale), cosmap or sigma_sqrt (uniform t, the loss weighted by cosmap or "
        "t^-2), uniform", default="logit_normal")
    mode_scale: Number = key("a number in [-1, 2 / (pi - 2)] (mode sampling's scale; SD3: 1.29)", default=1.29)
    shift_terminal: Optional[Number] = key("null (no stretch) or a number in (0, 1): the sampling grid's last "
                                           "non-zero t (LTX-Video's scheduler: 0.1; training t is unchanged)",
                                           gt=0, lt=1, default=None)

    @model_validator(mode="after")
    def check_one_shift(self) -> "RFConfig":
        if self.dynamic_shift is not None and self.shift != 1:
            RectifiedFlow(shift=self.shift, dynamic_shift=self.dynamic_shift.model_dump())   # says why, once
        RectifiedFlow(weighting_scheme=self.weighting_scheme, mode_scale=self.mode_scale)   # mode_scale's range
        return self

    def check(self) -> None:
        """A key only some weighting schemes read, set away from its default under another: refused."""
        for name, (schemes, default) in SCHEME_KEYS.items():
            value = getattr(self, name)
            if self.weighting_scheme not in schemes and value != default:
                raise ConfigError(f"diffusion.{name}={value} is read with diffusion.weighting_scheme="
                                  f"{' or '.join(schemes)} only; diffusion.weighting_scheme={self.weighting_scheme} "
                                  f"ignores it. Allowed: diffusion.weighting_scheme={schemes[0]}, or diffusion.{name} "
                                  f"left at {default}.")


# RFConfig's keys that only some weighting schemes read (diffusers' compute_density_for_timestep_sampling:
# logit_mean and logit_std for logit_normal, mode_scale for mode), with diffusers' defaults (its train scripts'
# --logit_mean 0, --logit_std 1, --mode_scale 1.29): another scheme accepts a key only at that value.
SCHEME_KEYS = {"P_mean": (("logit_normal",), 0.0), "P_std": (("logit_normal",), 1.0), "mode_scale": (("mode",), 1.29)}




class AdamCommon(Section):
    """the keys AdamW and its 8-bit version share"""

    partial: Literal[True] = key("true", alias="_partial_")
    lr: PositiveNumber
    betas: list[Number] = key("[beta1, beta2], each in [0, 1)", min_length=2, max_length=2)
    weight_decay: NonNegativeNumber
    eps: PositiveNumber

    def check(self) -> None:
        if not all(0 <= b < 1 for b in self.betas):
            raise ConfigError(f"optimizer.betas={list(self.betas)} is not allowed; allowed: [beta1, beta2], each in "
                              f"[0, 1).")


class AdamW(AdamCommon):
    """optimizer=adamw"""

    target: Literal["torch.optim.AdamW"] = key("torch.optim.AdamW", alias="_target_")
    fused: Optional[bool] = key("true, false or null (torch's default implementation)")


class AdamW8bit(AdamCommon):
    """optimizer=adamw8bit"""

    target: Literal["torchao.optim.AdamW8bit"] = key("torchao.optim.AdamW8bit", alias="_target_")
    block_size: int = key("a positive integer (values per 8-bit scale; torchao's default 256)", ge=1, default=256)
