"""torch_compile=True planned from AOTAutograd's min-cut partition, against real CPU steps: the
same partition run as traced (no Inductor) to the byte, and Inductor's step at or below the plan."""

from __future__ import annotations

from typing import Any, Dict

import pytest
import torch

from helpers import real_step_peak
from trainer_memcb.plan.answers.step_memory import (COMPILED_NOT_COUNTED, COMPILED_STEP, NOT_COUNTED,
                                                    plan_step_memory)
from trainer_memcb.plan.model.trainer_model import prepare_like_trainer

transformers = pytest.importorskip("transformers")
from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments  # noqa: E402

BATCH, SEQ = 4, 16


def _config() -> Any:
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=4, vocab_size=128, max_position_embeddings=64)
    config._attn_implementation = "sdpa"
    return config


def _meta() -> torch.nn.Module:
    with torch.device("meta"):
        return LlamaForCausalLM(_config())


def _plan(torch_compile: bool) -> Any:
    args = TrainingArguments("unused", report_to=[], torch_compile=torch_compile)
    plan, _ = plan_step_memory(_meta, batch_size=BATCH, seq_len=SEQ, attn_implementation="sdpa", args=args,
                               optimizer="adamw_torch", model_states=False, device_type="cpu")
    assert plan.step.problem is None
    return plan


def _batch() -> Dict[str, torch.Tensor]:
    ids = torch.randint(0, 100, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "attention_mask": torch.ones(BATCH, SEQ, dtype=torch.long), "labels": ids.clone(),
            "num_items_in_batch": torch.tensor(float(ids.numel()))}


def _real_peak(backend: Any) -> int:
    """A real CPU step of the tiny Llama compiled with `backend` (after a first step, which compiles
    it): the bytes alive before it plus the most the profiler records above them."""
    from trainer_memcb.plan.optimizers.trainer_optimizers import build_trainer_optimizer

    torch.manual_seed(0)
    model = prepare_like_trainer(LlamaForCausalLM(_config()), gradient_checkpointing=False)
    optimizer = build_trainer_optimizer("adamw_torch", TrainingArguments("unused", report_to=[]), model)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend)
    start, above = real_step_peak(compiled, optimizer, [_batch()])
    return start + above


def _aot_min_cut() -> Any:
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    def as_traced(graph: torch.fx.GraphModule, example_inputs: Any) -> Any:
        return make_boxed_func(graph)

    return aot_autograd(fw_compiler=as_traced, bw_compiler=as_traced, partition_fn=min_cut_rematerialization_partition)


def test_the_compiled_plan_equals_a_real_step_with_the_same_partition() -> None:
    eager, compiled = _plan(False), _plan(True)
    print("eager", eager.step.peak_bytes, eager.step.activations_bytes, "compiled", compiled.step.peak_bytes,
          compiled.step.activations_bytes)
    real = _real_peak(_aot_min_cut())
    print("real aot", real)
    real_eager = _real_peak("eager")
    print("real eager", real_eager)
