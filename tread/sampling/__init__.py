"""Sampling from a denoiser: per-seed generation, guidance as wrappers over a denoiser (CFG, inference routing, TREAD
guidance, path drop, interval; Guidance.denoiser builds the stack), loading a checkpoint for inference and what
sampling costs. The samplers themselves (EDM Heun, rectified-flow Euler) live in diffusion/ and only call a
denoiser."""
from tread.sampling.cost import sampling_cost, sampling_flops_per_image
from tread.sampling.generate import class_for_seed, generate, parse_seeds, text_conditioning_for_seeds
from tread.sampling.guidance import Guidance, GuidanceError, classifier_free_guidance
from tread.sampling.load import load_for_inference, text_conditioning

__all__ = ["Guidance", "GuidanceError", "class_for_seed", "classifier_free_guidance", "generate",
           "load_for_inference", "parse_seeds", "sampling_cost", "sampling_flops_per_image",
           "text_conditioning", "text_conditioning_for_seeds"]
