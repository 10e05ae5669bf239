"""`--write-accelerate-config FILE`: the `accelerate launch --config_file` that runs a `--fit`
proposal's layout, as `accelerate config` writes it.

The Trainer takes a tensor-parallel layout from accelerate, not from a TrainingArguments JSON (its
`parallelism_config` is a `ParallelismConfig` object): `accelerate launch` reads the config file's
`parallelism_config` section and hands the sizes to each process as `PARALLELISM_CONFIG_*`
variables (`utils/launch.py`, `prepare_extend_env_parallelism_config`), which the Accelerator the
Trainer makes reads (`ParallelismConfig.__post_init__`). `accelerate launch` takes that section
only with FSDP2 (`--use_parallelism_config` needs `--use_fsdp` and `--fsdp_version=2`), so the
config is FSDP's, version 2, resharding after the forward as the plan traces it. The file is YAML,
or JSON where its name ends in `.json`; both are what `load_config_from_file` reads.
"""

from __future__ import annotations

import json
from typing import Any, Dict, Mapping, Optional

__all__ = ["accelerate_config_of", "accelerate_config_text"]


def accelerate_config_of(training_args: Mapping[str, Any], world_size: int, nodes: int) -> Optional[Dict[str, Any]]:
    """The accelerate config of a proposal's `TrainingArguments` dict on `world_size` processes over
    `nodes` machines: FSDP2 with its `parallelism_config` sizes where the dict has a layout, FSDP2
    alone where it shards with FSDP; None otherwise (DeepSpeed's proposals write their own config,
    DDP needs none)."""
    layout = training_args.get("parallelism_config")
    fsdp = training_args.get("fsdp")
    if not layout and not fsdp:
        return None
    fsdp_config = dict(training_args.get("fsdp_config") or {})
    mixed = "bf16" if training_args.get("bf16") else ("fp16" if training_args.get("fp16") else "no")
    config: Dict[str, Any] = {
        "compute_environment": "LOCAL_MACHINE", "distributed_type": "FSDP", "mixed_precision": mixed,
        "num_machines": nodes, "num_processes": world_size, "machine_rank": 0, "use_cpu": False, "debug": False,
        "rdzv_backend": "static", "same_network": True, "main_training_function": "main",
        "fsdp_config": {"fsdp_version": 2,
                        "fsdp_reshard_after_forward": bool(fsdp_config.get("reshard_after_forward", True)),
                        "fsdp_offload_params": bool(fsdp_config.get("cpu_offload", False)),
                        "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
                        "fsdp_state_dict_type": "SHARDED_STATE_DICT",
                        "fsdp_activation_checkpointing": False},
    }
    if layout:
        config["parallelism_config"] = {f"parallelism_config_{name}_size": int(layout.get(f"{name}_size") or 1)
                                        for name in ("dp_replicate", "dp_shard", "tp", "cp")}
    return config


def accelerate_config_text(config: Mapping[str, Any], path: str) -> str:
    """`config` as the file `path` names: JSON for a `.json` name, else YAML (accelerate's own
    reader takes both)."""
    if path.endswith(".json"):
        return json.dumps(config, indent=2, sort_keys=True) + "\n"
    import yaml

    return yaml.safe_dump(dict(config), sort_keys=True)
