"""Diffusion objectives. Each has precondition(model), loss(net, x, labels) and sample(net, noise, labels)."""
from diffusion.common import StackedRandomGenerator, classifier_free_guidance
from diffusion.edm import EDM, EDMPrecond
from diffusion.rf import RectifiedFlow, RFModel

__all__ = ["EDM", "EDMPrecond", "RFModel", "RectifiedFlow", "StackedRandomGenerator", "classifier_free_guidance"]
