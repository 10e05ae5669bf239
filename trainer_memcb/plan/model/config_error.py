"""The error of a model that cannot be built, or fed, from its config.

It lives in the model stage because both the model's batch (`step_inputs`: a config with no
token) and the optimizers' what-if (`whatif.build_meta_model`: a config that cannot be read)
raise it; the command answers it as a bad config (exit 1).
"""

from __future__ import annotations

__all__ = ["ModelConfigError"]


class ModelConfigError(Exception):
    """A model that cannot be built from its config; the message says where it looked."""
