"""Suite-wide isolation for process-wide state that real libraries keep between tests."""

from __future__ import annotations

import sys

import pytest


@pytest.fixture(autouse=True)
def fresh_bitsandbytes_overrides():
    """bitsandbytes keeps per-parameter overrides in a process-wide `GlobalOptimManager`, keyed by
    (group, position): a Trainer run with `optim="adamw_bnb_8bit"` leaves 32-bit overrides there
    that would apply to the first parameters of any later bitsandbytes optimizer. Start and end
    every test with an empty manager (only when bitsandbytes is already imported)."""

    def reset() -> None:
        module = sys.modules.get("bitsandbytes.optim")
        if module is not None:
            module.GlobalOptimManager.get_instance().initialize()

    reset()
    yield
    reset()
