"""--fit's proposals share a model-states plan where they read the same one (`_states_for`)."""

from __future__ import annotations

import argparse
import dataclasses

from trainer_memcb.cli import estimate_step
from trainer_memcb.plan.settings import resolve_settings


def test_the_states_plan_is_made_once_per_optimizer_and_setup(monkeypatch):
    built, planned = [], []
    monkeypatch.setattr(estimate_step, "estimate_model", lambda args: built.append(args) or "model")

    def plan_model_states(model, optimizer, setup, **options):
        planned.append((optimizer, setup.world_size, options["reference_model"]))
        return f"states {len(planned)}"

    monkeypatch.setattr("trainer_memcb.plan.answers.model_states.plan_model_states", plan_model_states)
    args = argparse.Namespace(model="a model", reference_model=False)
    kept: dict = {}
    own = resolve_settings(batch_size=8, seq_len=16, optimizer="adamw_torch")
    assert estimate_step._states_for(args, False, kept, own) == "states 1"
    # A smaller batch, checkpointing, expandable segments: the same states plan, no model built.
    for other in (dataclasses.replace(own, batch_size=2), dataclasses.replace(own, gradient_checkpointing=True),
                  dataclasses.replace(own, alloc_conf="expandable_segments:True")):
        assert estimate_step._states_for(args, False, kept, other) == "states 1"
    assert len(built) == 1
    # Another optimizer or another setup: planned anew.
    assert estimate_step._states_for(args, False, kept, dataclasses.replace(own, optimizer="adafactor")) == "states 2"
    assert estimate_step._states_for(args, False, kept, dataclasses.replace(own, world_size=2)) == "states 3"
    assert planned == [("adamw_torch", 1, False), ("adafactor", 1, False), ("adamw_torch", 2, False)]
    assert len(built) == 3
