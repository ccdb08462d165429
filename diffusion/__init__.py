"""Diffusion objectives. Each has precondition(model), loss(net, x, labels) and sample(denoise, noise, labels);
samplers only call a denoiser (diffusion.common.Denoiser) and know nothing of guidance or routing."""
from diffusion.common import Denoiser, StackedRandomGenerator
from diffusion.edm import EDM, EDMPrecond
from diffusion.rf import RectifiedFlow, RFModel

__all__ = ["Denoiser", "EDM", "EDMPrecond", "RFModel", "RectifiedFlow", "StackedRandomGenerator"]
