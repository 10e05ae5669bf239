"""DeepSpeed's own model-states estimators beside the ZeRO step plan, term by term, to the byte.

DeepSpeed 0.19.8 estimates the model states of ZeRO-2 and ZeRO-3 with
`estimate_zero2_model_states_mem_needs` (`runtime/zero/stage_1_and_2.py`) and
`estimate_zero3_model_states_mem_needs` (`runtime/zero/stage3.py`), which its `..._all_cold`
functions print for every offload setting with `additional_buffer_factor=1.5`. Here the installed
functions are called, and each figure is split into the terms its source names, so that each
term can stand beside what the engine-traced step plan holds of the same state
(`StepMemoryPlan.step.model_states_most_bytes`, `model_states_at_optimizer_step_bytes`,
`model_states_host_bytes`):

- ZeRO-2, GPU: `2Ψ + 18Ψ/N`, "2 = params_16bit, 18 = 2_grads_16bit + 4_grads_32bit +
  4_params_32bit + 8_optimizer_states_32bit" (its comment): the 16-bit parameters whole, the 16-bit
  gradient partition, the fp32 gradient partition, the fp32 master partition and Adam's two moments;
  with `cpu_offload`, `2Ψ` (the 16-bit parameters) alone.
- ZeRO-3, GPU: `4 x largest layer` (its gathered 16-bit parameters and 16-bit gradients) `+ 18Ψ/N`;
  the 18 has no 16-bit gradient partition: with the optimizer offloaded the GPU keeps `2Ψ/N` (the
  16-bit parameter partition) and the CPU `16Ψ/N` a process (fp32 gradients, master, moments), with
  the parameters offloaded too 18.
- CPU, per node: what loading takes (ZeRO-2, and ZeRO-3 without `zero_init`: an fp32 copy of the
  model per process of the node, `4Ψ x gpus per node`; ZeRO-2 with offload `max(4Ψ x all GPUs,
  16Ψ)`) or what offload keeps there (`16Ψ` or `18Ψ` over the nodes), times the buffer factor.

Ψ: the parameters (`model_to_params`: tied ones once); the largest layer: the most parameters one
module holds itself (`stage3.py` `model_to_params`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Tuple

__all__ = ["DeepSpeedFigures", "PlanFigures", "TERMS", "ZERO_ROWS", "deepspeed_config", "deepspeed_figures", "largest_layer_params",
           "legend_lines", "plan_figures", "plan_row", "summary_lines", "term_lines", "total_params", "trainer_groups"]

# (label, ZeRO stage, offload_optimizer, offload_param): the settings DeepSpeed's `..._all_cold`
# functions print (stage 2: with and without `cpu_offload`; stage 3: each offload, `zero_init=1`).
ZERO_ROWS = (
    ("ZeRO-2", 2, False, False),
    ("ZeRO-2, offload optimizer", 2, True, False),
    ("ZeRO-3", 3, False, False),
    ("ZeRO-3, offload optimizer", 3, True, False),
    ("ZeRO-3, offload optimizer and params", 3, True, True),
)
# `estimate_zero*_model_states_mem_needs_all_cold`'s default.
BUFFER_FACTOR = 1.5


def total_params(model: Any) -> int:
    """DeepSpeed's `model_to_params`: every parameter once (tied ones once, by identity here, as
    `data_ptr` is on a real model)."""
    return sum({id(p): p.numel() for p in model.parameters()}.values())


def largest_layer_params(model: Any) -> int:
    """`stage3.py` `model_to_params`: the most parameters one module holds itself."""
    return max(sum(p.numel() for p in module.parameters(recurse=False)) for module in model.modules())


# The terms either side counts, by key: what each is, and why the other side counts it or not.
TERMS = {
    "params16_whole": ("16-bit parameters, whole", "ZeRO-2 keeps every parameter whole: both count 2Ψ"),
    "params16_partition": ("16-bit parameter partition", "ZeRO-3: DeepSpeed 2Ψ/N; the plan ceil(numel / N) per "
                           "parameter (`partition_parameters.py` `_padding_size`)"),
    "params16_persistent": ("16-bit persistent parameters, whole", "ZeRO-3: parameters under "
                            "`stage3_param_persistence_threshold` stay whole beside their partition; the estimator "
                            "has no term for them"),
    "params16_gathered": ("16-bit parameters gathered", "ZeRO-3: DeepSpeed 2 x the largest layer (its 4x: 2 bytes "
                          "for its parameters, 2 for its gradients); the plan what the traced step holds whole at "
                          "the parameters' most (prefetched up to `stage3_max_live_parameters`, and kept whole from forward to "
                          "backward within `stage3_max_reuse_distance`)"),
    "grads16_whole": ("16-bit gradients in flight", "DeepSpeed's other 2 x the largest layer (ZeRO-3); the plan the "
                      "whole gradients and buckets the traced step holds at the gradients' most beyond the terms below"),
    "grads16_partition": ("16-bit gradient partition", "ZeRO-2: DeepSpeed 2Ψ/N, the plan the gradients of every "
                          "parameter the partition touches, whole (`copy_grads_in_partition`); ZeRO-3: the plan's "
                          "`grad_partitions_flat_buffer`, which DeepSpeed's 18 (2 + 4 + 4 + 8) leaves out"),
    "reduce_bucket": ("reduce bucket", "`reduce_bucket_size` 16-bit values (ZeRO-3 keeps it through the step); "
                      "no estimator term"),
    "grads32_partition": ("fp32 gradient partition", "DeepSpeed 4Ψ/N; the plan one param group's (ZeRO-3: one "
                          "sub-group's) at a time, inside the step (`_optimizer_step`); offload keeps it whole on "
                          "the host between steps (ZeRO-1/2: `single_partition_of_fp32_groups[i].grad`; ZeRO-3: "
                          "each sub-group's, `_release_sub_group`)"),
    "master32": ("fp32 master partition", "4 bytes a value of the partitions, padded per param group"),
    "moments32": ("AdamW's two moments", "8 bytes a value of the partitions"),
    "adam_steps": ("AdamW's `step` tensors", "4 bytes per flat partition (torch AdamW, the Trainer's); no term"),
    "offload_copies": ("offload's 16-bit copies and staging", "ZeRO-1/2 offload: the partition's 16-bit host copy "
                       "and the largest parameter's staging buffers (`temp_buffer_bit16`, "
                       "`temp_grad_buffer_for_cpu_offload` / `_gpu_offload`); no term"),
    "loading": ("fp32 copies while loading", "DeepSpeed's CPU figure counts the model loaded in fp32 per process "
                "(ZeRO-3 with zero_init: the largest layer), before training; the plan counts the step"),
    "buffer_factor": ("additional buffer factor", "DeepSpeed multiplies its CPU figure by 1.5 (`_all_cold`'s "
                      "default); the plan counts each buffer it models, and no factor"),
    "rounding": ("int() rounding", "DeepSpeed's float arithmetic"),
}


@dataclass(frozen=True)
class DeepSpeedFigures:
    """DeepSpeed's figures for one setting, as its installed function returns them, and their terms.

    Attributes:
        gpu_bytes, cpu_bytes_per_node: the function's return values.
        gpu_terms, cpu_terms: `TERMS` key -> bytes, summing to those values to the byte.
    """

    gpu_bytes: int
    cpu_bytes_per_node: int
    gpu_terms: Dict[str, int] = field(default_factory=dict)
    cpu_terms: Dict[str, int] = field(default_factory=dict)


def _closed(terms: Dict[str, int], total: int) -> Dict[str, int]:
    rest = total - sum(terms.values())
    return dict(terms, rounding=rest) if rest else dict(terms)


def deepspeed_figures(stage: int, offload_optimizer: bool, offload_param: bool, psi: int, largest: int,
                      gpus_per_node: int, nodes: int, buffer_factor: float = BUFFER_FACTOR) -> DeepSpeedFigures:
    """Call the installed DeepSpeed estimator for one setting (`zero_init=True` for stage 3, as its
    `..._all_cold` prints it) and split its figures into their terms."""
    n = gpus_per_node * nodes
    share = psi // n if psi % n == 0 else psi / n  # Ψ/N: exact for Llama-2-7B at 8 and 64
    per_node = share * gpus_per_node  # the node's processes' shares: Ψ / nodes
    if stage == 2:
        from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

        cpu, gpu = estimate_zero2_model_states_mem_needs(psi, gpus_per_node, nodes, cpu_offload=offload_optimizer,
                                                         additional_buffer_factor=buffer_factor)
        gpu_terms = {"params16_whole": 2 * psi}
        if offload_optimizer:  # cpu: psi * max(4 * total GPUs, 16) * factor
            base = {"loading": 4 * psi * n} if 4 * n >= 16 else {"grads32_partition": 4 * psi, "master32": 4 * psi,
                                                                   "moments32": 8 * psi}
        else:  # "2 = params_16bit, 18 = 2_grads_16bit + 4_grads_32bit + 4_params_32bit + 8_optimizer_states_32bit"
            gpu_terms.update(grads16_partition=int(2 * share), grads32_partition=int(4 * share), master32=int(4 * share),
                             moments32=int(8 * share))
            base = {"loading": 4 * psi * gpus_per_node}
    else:
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

        cpu, gpu, _ = estimate_zero3_model_states_mem_needs(psi, largest, gpus_per_node, nodes, cpu_offload=offload_optimizer,
                                                            cpu_offload_params=offload_param, zero_init=True,
                                                            additional_buffer_factor=buffer_factor)
        gpu_terms = {"params16_gathered": 2 * largest, "grads16_whole": 2 * largest}  # largest_layer_memory
        host = {"grads32_partition": int(4 * per_node), "master32": int(4 * per_node), "moments32": int(8 * per_node)}
        if not offload_optimizer:
            gpu_terms.update(params16_partition=int(2 * share), grads32_partition=int(4 * share), master32=int(4 * share),
                             moments32=int(8 * share))
            base = {"loading": 4 * largest * gpus_per_node}
        elif not offload_param:
            gpu_terms["params16_partition"] = int(2 * share)
            base = host
        else:
            base = dict(host, params16_partition=int(2 * per_node))
    base = dict(base, buffer_factor=int(sum(base.values()) * buffer_factor) - sum(base.values()))
    return DeepSpeedFigures(gpu, cpu, _closed(gpu_terms, gpu), _closed(base, cpu))


# -- the step plan's side ------------------------------------------------------------------------------


def trainer_groups(model: Any) -> List[List[int]]:
    """The numel of the trainable parameters of each param group of the Trainer's AdamW (decay,
    no decay), in order: DeepSpeed flattens and partitions each group apart."""
    from transformers import TrainingArguments

    from trainer_memcb.plan.optimizers.trainer_optimizers import build_trainer_optimizer

    optimizer = build_trainer_optimizer("adamw_torch", TrainingArguments(output_dir="zero-reference", report_to=[]), model)
    groups = [[p.numel() for p in group["params"] if p.requires_grad] for group in optimizer.param_groups]
    return [group for group in groups if group]


@dataclass(frozen=True)
class PlanFigures:
    """The engine-traced plan's model states for one setting, and their terms.

    Attributes:
        device_bytes: the sum over the model states of the most each held on the device during the
            step (`model_states_most_bytes`), as the plan's model-states table gives it.
        at_optimizer_step_bytes: the model states at the optimizer phase's peak, device and host
            (`model_states_at_optimizer_step_bytes`).
        host_bytes_per_node: what lives on the host (`model_states_host_bytes`), times the
            processes of a node.
        device_terms, host_terms: (term, bytes) summing to `device_bytes` and to the host figure of
            one process; the terms the rules give (partitions, their padding, the step tensors), and
            what the trace holds beyond them at each state's most (gathered parameters, whole
            gradients in flight, buckets), measured.
    """

    device_bytes: int
    at_optimizer_step_bytes: int
    host_bytes_per_node: int
    device_terms: List[Tuple[str, int]] = field(default_factory=list)
    host_terms: List[Tuple[str, int]] = field(default_factory=list)


def deepspeed_config(stage: int, offload_optimizer: bool, offload_param: bool) -> Dict[str, Any]:
    """The DeepSpeed config of a row, as a Trainer user writes it ("auto" sizes, bf16); the client
    optimizer (the Trainer's AdamW) is kept with offload (`zero_force_ds_cpu_optimizer: false`)."""
    zero: Dict[str, Any] = {"stage": stage, "reduce_bucket_size": "auto"}
    if stage == 3:
        zero.update(stage3_prefetch_bucket_size="auto", stage3_param_persistence_threshold="auto")
    if offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu"}
    if offload_param:
        zero["offload_param"] = {"device": "cpu"}
    return {"bf16": {"enabled": True}, "zero_force_ds_cpu_optimizer": False, "zero_optimization": zero}


def plan_row(build: Any, label: str, stage: int, offload_optimizer: bool, offload_param: bool, world: int,
             gpus_per_node: int = 8, batch_size: int = 1, seq_len: int = 512) -> Dict[str, Any]:
    """One row: the engine-traced step plan of the setting and DeepSpeed's figures for it."""
    from trainer_memcb.plan.settings import resolve_settings
    from trainer_memcb.plan.answers.step_memory import plan_step_memory

    model = build()
    config = model.config
    nodes = max(1, world // gpus_per_node)
    settings = resolve_settings(deepspeed=deepspeed_config(stage, offload_optimizer, offload_param), world_size=world,
                                nodes=nodes, hidden_size=config.hidden_size, batch_size=batch_size, optimizer="adamw_torch")
    plan, _ = plan_step_memory(build, seq_len=seq_len, settings=settings, device_type="cpu", model_states=False)
    if plan.step.problem is not None:
        raise RuntimeError(plan.step.problem)
    psi, largest = total_params(model), largest_layer_params(model)
    deepspeed = deepspeed_figures(stage, offload_optimizer, offload_param, psi, largest, world // nodes, nodes)
    return {"label": label, "stage": stage, "offload_optimizer": offload_optimizer, "offload_param": offload_param,
            "world": world, "nodes": nodes, "psi": psi, "largest": largest, "groups": trainer_groups(model),
            "settings": settings, "plan": plan, "deepspeed": deepspeed}


def plan_figures(row: Dict[str, Any]) -> PlanFigures:
    """The plan's model states of a row (`plan_row`), split into `TERMS`: those the engine's rules
    give (deepspeed 0.19.8, rank 0, as `trainer_memcb.plan.step.engines.zero` models them), and what the
    traced step holds beyond them at each state's most, measured (`params16_gathered`,
    `grads16_whole`)."""
    from trainer_memcb.state.rules.deepspeed_zero import (
        zero3_partition_numel,
        zero3_sub_group_numels,
        zero12_gradient_numel,
        zero12_partition_numel,
    )

    plan, settings, groups, world = row["plan"], row["settings"], row["groups"], row["world"]
    most, host, at_step = plan.step.model_states_most_bytes, plan.step.model_states_host_bytes, plan.step.model_states_at_optimizer_step_bytes
    numels = [numel for group in groups for numel in group]
    bucket = 2 * int(settings.zero["reduce_bucket_size"]) * (2 if settings.overlap_comm and row["stage"] != 3 else 1)
    if row["stage"] == 3:
        flat = [zero3_sub_group_numels(group, world, int(settings.zero["sub_group_size"])) for group in groups]
        partitions = [numel for group in flat for numel in group]
        threshold = int(settings.zero["stage3_param_persistence_threshold"])
        params = {"params16_partition": 2 * sum(zero3_partition_numel(n, world) for n in numels),
                  "params16_persistent": 2 * sum(n for n in numels if n < threshold)}
        grads = {"grads16_partition": 2 * sum(zero3_partition_numel(n, world) for n in numels), "reduce_bucket": bucket}
        # On the host where DeepSpeed makes them: the 16-bit gradient partition with offload_optimizer
        # (`grad_partitions_flat_buffer` on `self.device`), every 16-bit parameter partition with
        # offload_param (`_create_param_groups_fp16_flat_cpu_memory`).
        host16 = {}
        if row["offload_optimizer"]:
            host16["grads16_partition"] = grads.pop("grads16_partition")
        if row["offload_param"]:
            host16["params16_partition"] = params.pop("params16_partition")
    else:
        partitions = [zero12_partition_numel(group, world) for group in groups]
        params = {"params16_whole": 2 * sum(numels)}
        host16 = {}
        grads = {} if row["offload_optimizer"] else {"grads16_partition": 2 * zero12_gradient_numel(groups, world, 0)}
    optimizer = {"moments32": 8 * sum(partitions), "adam_steps": 4 * len(partitions)}
    master = {"master32": 4 * sum(partitions)}
    grads32 = {"grads32_partition": 4 * (sum(partitions) if row["offload_optimizer"] else max(partitions))}
    device: Dict[str, int] = dict(params)
    host_terms: Dict[str, int] = dict(host16)
    if row["offload_optimizer"]:
        host_terms.update(optimizer, **master, **grads32)
        if row["stage"] != 3:
            largest = max(numels)
            host_terms["offload_copies"] = 2 * sum(partitions) + 2 * largest  # the host copy, the host staging
            grads = {"offload_copies": 2 * largest}  # the device's staging buffer
    else:
        device.update(optimizer, **master, **grads32)
    device.update(grads)
    # What the trace holds beyond the rules' terms at the parameters' and the gradients' most.
    rule_params = sum(params.values())
    rule_grads = sum(grads.values()) + (0 if row["offload_optimizer"] else grads32["grads32_partition"])
    device["params16_gathered"] = most["parameters"] - rule_params
    device["grads16_whole"] = most["gradients"] - rule_grads
    device = {key: value for key, value in device.items() if value}
    processes = world // row["nodes"]
    return PlanFigures(sum(most.values()), sum(at_step.values()), sum(host.values()) * processes, device,
                       {key: value for key, value in host_terms.items() if value})


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / 2**30:.2f}"


def summary_lines(rows: List[Dict[str, Any]]) -> List[str]:
    """The guide's table: per row DeepSpeed's figures and the plan's (GiB, as DeepSpeed prints them)."""
    lines = ["| GPUs | setting | DeepSpeed per GPU | plan: most on the device | plan: at the optimizer step, device and host | "
             "DeepSpeed CPU per node | plan: host per node |", "|---|---|---:|---:|---:|---:|---:|"]
    for row in rows:
        ds, ours = row["deepspeed"], plan_figures(row)
        lines.append(f"| {row['world']} | {row['label']} | {_gib(ds.gpu_bytes)} | {_gib(ours.device_bytes)} | "
                     f"{_gib(ours.at_optimizer_step_bytes)} | {_gib(ds.cpu_bytes_per_node)} | {_gib(ours.host_bytes_per_node)} |")
    return lines


def term_lines(rows: List[Dict[str, Any]]) -> List[str]:
    """Per row and term, in bytes: DeepSpeed's and the plan's, each column summing to its figure."""
    lines = ["| GPUs | setting | term | DeepSpeed per GPU | plan on the device | DeepSpeed CPU per node | "
             "plan host per node |", "|---|---|---|---:|---:|---:|---:|"]
    for row in rows:
        ds, ours = row["deepspeed"], plan_figures(row)
        processes = row["world"] // row["nodes"]
        keys = [key for key in TERMS if key in ds.gpu_terms or key in ours.device_terms or key in ds.cpu_terms
                or ours.host_terms.get(key)]
        for key in keys:
            cells = [ds.gpu_terms.get(key, 0), ours.device_terms.get(key, 0), ds.cpu_terms.get(key, 0),
                     ours.host_terms.get(key, 0) * processes]
            lines.append(f"| {row['world']} | {row['label']} | {TERMS[key][0]} | " + " | ".join(f"{c:,}" for c in cells) + " |")
        totals = [ds.gpu_bytes, ours.device_bytes, ds.cpu_bytes_per_node, ours.host_bytes_per_node]
        lines.append(f"| {row['world']} | {row['label']} | **total** | " + " | ".join(f"{c:,}" for c in totals) + " |")
    return lines


def legend_lines() -> List[str]:
    """What each term is and why one side counts it and the other not."""
    return [f"- **{name}**: {why}." for name, why in TERMS.values()]
