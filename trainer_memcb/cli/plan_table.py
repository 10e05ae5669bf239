"""`trainer-memcb estimate MODEL --world-size W --sharding ...`: the model-states plan, as tables.

The figures come from `trainer_memcb.plan.model_states.plan_model_states`; this module only formats them.
"""

from __future__ import annotations

from typing import List

from trainer_memcb.cli.output import TextTable, bytes_cell, count_cell
from trainer_memcb.plan.model_states import ModelStatesPlan

__all__ = ["plan_tables"]


def _fits(plan: ModelStatesPlan, entry) -> str:
    if entry.fits is None:
        return "-"
    margin = bytes_cell(abs(entry.margin_bytes))
    return f"fits, {margin} to spare" if entry.fits else f"does not fit, {margin} short"


def plan_tables(plan: ModelStatesPlan) -> List[TextTable]:
    """The setup, then one row per optimizer: the four states of the fullest process and where they live."""
    setup = plan.setup
    offload = [name for name, on in (("optimizer", setup.offload_optimizer), ("parameters", setup.offload_params)) if on]
    about = TextTable(f"Model states plan for {plan.model}", ["", "value"], [
        ["parameters", count_cell(plan.total_params)],
        ["trainable parameters", count_cell(plan.trainable_params)],
        ["processes", f"{setup.world_size} on {setup.nodes} node{'s' if setup.nodes > 1 else ''}"],
        ["sharding", setup.sharding],
        ["precision", setup.precision],
        ["offload to CPU", ", ".join(offload) or "none"],
        ["device memory", bytes_cell(plan.device_memory_bytes)],
    ] + ([["reference model (frozen copy)", plan.reference_model_note
           or bytes_cell(plan.optimizers[0].reference_model_bytes if plan.optimizers else None)]]
         if plan.reference_model else []))
    rows = []
    for entry in plan.optimizers:
        if entry.model_states_bytes is None:
            rows.append([entry.name, bytes_cell(entry.params_bytes), bytes_cell(entry.grads_bytes), "-",
                         bytes_cell(entry.master_weights_bytes), "-", "-", "-", entry.problem or "-"])
            continue
        rows.append([entry.name, bytes_cell(entry.params_bytes), bytes_cell(entry.grads_bytes),
                     bytes_cell(entry.optimizer_state_bytes), bytes_cell(entry.master_weights_bytes),
                     bytes_cell(entry.model_states_bytes), bytes_cell(entry.device_bytes),
                     bytes_cell(entry.cpu_bytes_per_node), _fits(plan, entry)])
    states = TextTable(
        "Per process (the fullest): parameters, gradients, optimizer state, master weights"
        + (" (model states include the reference model)" if plan.reference_model else "")
        + ". Not counted: activations, temporary buffers, CUDA context, fragmentation",
        ["optimizer", "parameters", "gradients", "optimizer state", "master weights", "model states",
         "on the device", "CPU per node", "fits?"],
        rows, text_columns=(0, 8),
    )
    return [about, states]
