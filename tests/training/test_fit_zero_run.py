"""A ZeRO proposal of the fit search against a real run: the DeepSpeed config it proposes, handed
to DeepSpeed as the Trainer hands it, on 2 CPU processes under torchrun (gloo), torch's MemTracker
on the third step (tests/dist_scripts/zero_step_profile.py, as tests/training/test_engine_runs.py
measures the engines). The proposal said to fit a limit the user's own DDP step does not fit
really stays under it, at the plan's figure."""

from __future__ import annotations

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "plan"))
from test_engines import build  # noqa: E402
from test_engine_runs import ZERO_SCALARS, _launch  # noqa: E402

from trainer_memcb.plan.answers.fit import search_fits, step_planner  # noqa: E402

pytestmark = pytest.mark.slow

# Between the ZeRO-2 step (2,069,196 planned per process) and the own DDP step (2,464,920).
LIMIT = 2_100_000
OWN = {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 1, "optim": "adamw_torch",
       "gradient_checkpointing": False, "max_grad_norm": 1.0, "bf16": False, "fp16": False}


def test_a_zero_proposal_said_to_fit_stays_under_the_limit_at_the_plans_figure(tmp_path):
    planner = step_planner(build, 16, device_type="cpu", world_size=2)
    search = search_fits(planner, OWN, LIMIT, world_size=2, device_type="cpu", value_bytes=4)
    assert search.own.peak_bytes == 2_464_920 and search.fits_as_is is False
    zero2 = next(c for c in search.candidates if c.deepspeed and c.deepspeed["zero_optimization"]["stage"] == 2)
    assert zero2.fits is True and zero2.peak_bytes == 2_069_196
    with open(tmp_path / "proposal.json", "w") as handle:
        json.dump(zero2.deepspeed, handle)
    _launch("zero_step_profile.py", str(tmp_path), ["proposal-memtracker"])
    peaks = [json.load(open(tmp_path / "proposal-memtracker" / f"rank{rank}.json"))["peak_bytes"] for rank in (0, 1)]
    # DeepSpeed's four fp32 0-dim scalars, which the fake step does not make (test_engine_runs.py).
    assert peaks == [zero2.peak_bytes + ZERO_SCALARS["zero2"]] * 2
    assert max(peaks) <= LIMIT < search.own.peak_bytes
