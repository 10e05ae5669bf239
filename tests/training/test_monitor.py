"""`OptimizerStateMonitor`: breakdown parts that share a safe name, and figures handed out that
their receiver may change. Real optimizers, exact bytes."""

from __future__ import annotations

import warnings

import torch

from trainer_memcb.training.figures import MEASURED_BYTES
from trainer_memcb.training.monitor import OptimizerStateMonitor


def test_breakdown_parts_that_share_a_safe_name_add_up():
    # State keys "a.b" and "a_b" both become the part "a_b": their bytes are summed, not replaced.
    layer = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    optimizer.state[layer.weight] = {"a.b": torch.zeros(3), "a_b": torch.zeros(5)}
    monitor = OptimizerStateMonitor(breakdown=("key",))
    monitor.attach(optimizer)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # SGD's rule knows neither key: the difference is warned about
        figures = monitor.figures(1, stepped=True)
    assert figures[MEASURED_BYTES] == 32
    assert figures["optimizer_state_bytes_by_key/a_b"] == 32


def test_figures_asked_again_at_a_step_are_a_fresh_dict_each_time():
    # Asked again at the same step (an evaluation entry after a training entry), the figures are
    # reused without measuring again; each caller still gets a dict of its own to change.
    layer = torch.nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(layer.parameters())
    layer(torch.ones(1, 4)).sum().backward()
    optimizer.step()
    monitor = OptimizerStateMonitor()
    monitor.attach(optimizer)
    handed_out = [monitor.figures(1, stepped=True) for _ in range(3)]
    handed_out[1]["loss"] = 0.5
    handed_out[2].clear()
    again = monitor.figures(1, stepped=True)
    assert "loss" not in again and again[MEASURED_BYTES] == handed_out[0][MEASURED_BYTES] == 88
