"""The models' user error: a model config that cannot be built."""
from __future__ import annotations

from tread.utils.errors import UserError


class ModelConfigError(UserError):
    """A model config that cannot be built; the message names the key, the value and what is allowed."""


class FamilyConfigError(ModelConfigError):
    """A family config that cannot be built; the message names the key, the value and what is allowed."""
