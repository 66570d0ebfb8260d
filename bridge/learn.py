"""The name `clawbridge.server` looks up for the learning loop; it lives in `clawbridge.learner`."""

from clawbridge.learner import Learner, serving_extras

__all__ = ["Learner", "serving_extras"]
