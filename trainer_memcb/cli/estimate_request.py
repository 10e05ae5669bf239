"""`trainer-memcb estimate`'s command line as one typed, frozen request (`EstimateRequest`), read
once from the parsed options (`EstimateRequest.of`): each option a field of its type, --gpu's memory
as --device-memory where that is not given, and which plans are asked (`questions`). Everything
after the parse takes the request, and what changes an option (the optimizers' names resolved,
the fit search's proposals) makes a new request with `dataclasses.replace`; nothing reads or
changes the parser's namespace. Importable without torch."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

from trainer_memcb.cli.estimate_asked import EstimateQuestions

__all__ = ["EstimateRequest"]


@dataclass(frozen=True)
class EstimateRequest:
    """The options of `trainer-memcb estimate MODEL`, one field each (their meaning is their
    option's help, `trainer_memcb.cli.estimate_options`), as the parser typed them."""

    model: str
    optimizers: Union[str, Sequence[str]]
    optim_args: Optional[Dict[str, Any]] = None
    optim_target_modules: Any = None
    architecture: Optional[str] = None
    dtype: Optional[str] = None
    lora_r: Optional[int] = None
    lora_target_modules: Optional[str] = None
    lora_modules_to_save: Optional[str] = None
    trainable: Optional[str] = None
    json: bool = False
    # The layout.
    world_size: Optional[int] = None
    rank: Optional[int] = None
    nodes: Optional[int] = None
    parallelism: Any = None
    tp_plan: Optional[Dict[str, str]] = None
    sharding: Optional[str] = None
    zero: Optional[int] = None
    offload_optimizer: bool = False
    offload_params: bool = False
    precision: Optional[str] = None
    replicate: Optional[int] = None
    # The device.
    device_memory: Optional[int] = None
    gpu: Optional[str] = None
    alloc_conf: Any = None
    reserve: Optional[int] = None
    reference_model: bool = False
    # The step.
    batch_size: Optional[int] = None
    seq_len: Optional[int] = None
    gradient_accumulation_steps: Optional[int] = None
    gradient_checkpointing: bool = False
    attn_implementation: Optional[str] = None
    device_type: Optional[str] = None
    max_batch_size: bool = False
    target_len: Optional[int] = None
    image_size: Optional[int] = None
    padding: int = 0
    torch_compile: Optional[bool] = None
    use_liger_kernel: Optional[bool] = None
    liger_kernel_config: Optional[Dict[str, bool]] = None
    packing: Optional[int] = None
    write_snapshot: Optional[str] = None
    write_html: Optional[str] = None
    # QLoRA's loading.
    load_in_4bit: bool = False
    load_in_8bit: bool = False
    llm_int8_threshold: Optional[float] = None
    bnb_4bit_quant_type: str = "nf4"
    bnb_4bit_use_double_quant: bool = False
    bnb_4bit_compute_dtype: str = "float32"
    # The settings files (the fit search's proposals give them as dicts).
    training_args: Union[None, str, Dict[str, Any]] = None
    trainer: str = "trainer"
    deepspeed: Union[None, str, Dict[str, Any]] = None
    fsdp_config: Union[None, str, Dict[str, Any]] = None
    bucket_cap_mb: Optional[float] = None
    gradient_as_bucket_view: bool = False
    # The evaluation plan.
    eval_samples: Optional[int] = None
    eval_batch_size: Optional[int] = None
    eval_accumulation_steps: Optional[int] = None
    no_eval_concat: bool = False
    eval_logits: Optional[str] = None
    eval_include_inputs: bool = False
    host_memory: Optional[int] = None
    # --fit.
    fit: bool = False
    allow: Union[List[str], Tuple[str, ...]] = ()
    max_proposals: int = 16
    write_training_args: Optional[str] = None
    write_deepspeed: Optional[str] = None
    write_accelerate_config: Optional[str] = None
    force: bool = False
    # The output.
    verbose: bool = False
    debug: bool = False
    # Which plans the options ask for (`EstimateQuestions.of`), read once.
    questions: EstimateQuestions = EstimateQuestions(step=False, plan=False, evaluation=False)

    @classmethod
    def of(cls, args: argparse.Namespace) -> "EstimateRequest":
        """The request of the parsed options: --gpu's memory as --device-memory where that is not
        given (it overrides the preset's), and the plans asked."""
        fields = {item.name for item in dataclasses.fields(cls)} - {"questions"}
        request = cls(**{name: getattr(args, name) for name in fields if hasattr(args, name)})
        if request.gpu is not None and request.device_memory is None:
            from trainer_memcb.plan.device.gpus import gpu_preset

            request = dataclasses.replace(request, device_memory=gpu_preset(request.gpu).total_bytes)
        return dataclasses.replace(request, questions=EstimateQuestions.of(request))
