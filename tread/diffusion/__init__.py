"""Diffusion objectives. Each has precondition(model), loss(net, x, labels) and sample(denoise, noise, labels);
samplers only call a denoiser (tread.diffusion.common.Denoiser) and know nothing of guidance or routing."""
from tread.diffusion.common import Denoiser, StackedRandomGenerator
from tread.diffusion.edm import EDM, EDMPrecond
from tread.diffusion.rf import RectifiedFlow, RFModel

__all__ = ["Denoiser", "EDM", "EDMPrecond", "RFModel", "RectifiedFlow", "StackedRandomGenerator"]
