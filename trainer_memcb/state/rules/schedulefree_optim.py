"""Rules for schedule-free optimizers (schedulefree 1.4.1: schedulefree/*.py).

Registered by `"module:ClassName"`: nothing here imports schedulefree. Every buffer is a clone
or `zeros_like` of the parameter (its dtype); `k`, `weight_sum`, `lr_max` are Python numbers in
the param group.
"""

from __future__ import annotations

from trainer_memcb.state.registry import register_estimate_rule
from trainer_memcb.state.rules._common import step_and_buffers

# module:Class -> (parameter-sized buffers, source)
_CLASSES = {
    "schedulefree.adamw_schedulefree:AdamWScheduleFree": (
        ("z", "exp_avg_sq"), "schedulefree/adamw_schedulefree.py AdamWScheduleFree.step"),
    "schedulefree.adamw_schedulefree_closure:AdamWScheduleFreeClosure": (
        ("z", "exp_avg_sq"), "schedulefree/adamw_schedulefree_closure.py AdamWScheduleFreeClosure.step"),
    "schedulefree.adamw_schedulefree_paper:AdamWScheduleFreePaper": (
        ("z", "exp_avg_sq"), "schedulefree/adamw_schedulefree_paper.py AdamWScheduleFreePaper.step"),
    "schedulefree.adamw_schedulefree_reference:AdamWScheduleFreeReference": (
        ("z", "exp_avg_sq", "x", "y"), "schedulefree/adamw_schedulefree_reference.py AdamWScheduleFreeReference.step"),
    "schedulefree.radam_schedulefree:RAdamScheduleFree": (
        ("z", "exp_avg_sq"), "schedulefree/radam_schedulefree.py RAdamScheduleFree.step"),
    "schedulefree.radam_schedulefree_closure:RAdamScheduleFreeClosure": (
        ("z", "exp_avg_sq"), "schedulefree/radam_schedulefree_closure.py RAdamScheduleFreeClosure.step"),
    "schedulefree.sgd_schedulefree:SGDScheduleFree": (
        ("z",), "schedulefree/sgd_schedulefree.py SGDScheduleFree.step"),
    "schedulefree.sgd_schedulefree_closure:SGDScheduleFreeClosure": (
        ("z",), "schedulefree/sgd_schedulefree_closure.py SGDScheduleFreeClosure.step"),
    "schedulefree.sgd_schedulefree_reference:SGDScheduleFreeReference": (
        ("z", "x", "y"), "schedulefree/sgd_schedulefree_reference.py SGDScheduleFreeReference.step"),
}

for _name, (_buffers, _source) in _CLASSES.items():
    register_estimate_rule(_name, step_and_buffers((), dict.fromkeys(_buffers)), source=_source)
