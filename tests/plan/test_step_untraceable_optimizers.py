"""Optimizers whose constructor cannot run under fake tensors: the step is still planned.

bitsandbytes' 8-bit optimizers read a value at construction (`aten._local_scalar_dense`), which a
fake tensor has not. The plan traces forward and backward, takes the optimizer state from the
optimizer's estimate rule (`trainer_memcb.state.rules.bitsandbytes_optim`), holds it through the
step as every later step does, and says so in a note; the update's own temporaries are not traced.
Checked against a real CPU step of the Trainer's `adamw_bnb_8bit` (embeddings kept 32-bit, as the
Trainer registers them).
"""

from __future__ import annotations

import pytest
import torch

from helpers import requires_transformers, training_args, tiny_llama_config
from trainer_memcb.plan.answers.model_states import plan_model_states
from trainer_memcb.plan.answers.step_memory import plan_step_memory

pytest.importorskip("bitsandbytes")
transformers = pytest.importorskip("transformers")
from transformers import LlamaConfig, LlamaForCausalLM, Trainer  # noqa: E402

B, S = 2, 16


def config() -> LlamaConfig:
    return tiny_llama_config("eager")


def build() -> torch.nn.Module:
    with torch.device("meta"):
        return LlamaForCausalLM(config())


def real_state_bytes(tmp_path) -> int:
    torch.manual_seed(0)
    trainer = Trainer(model=LlamaForCausalLM(config()), args=training_args(str(tmp_path), optim="adamw_bnb_8bit"))
    trainer.create_optimizer()
    model, optimizer = trainer.model.train(), trainer.optimizer
    ids = torch.randint(0, 128, (B, S))
    model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids).loss.backward()
    optimizer.step()
    storages = {}
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                storages[value.untyped_storage()._cdata] = value.untyped_storage().nbytes()
    return sum(storages.values())


@requires_transformers("5.0", "the Trainer's bitsandbytes optimizer registration of transformers 5")
def test_an_8bit_optimizer_is_planned_with_its_rules_state(tmp_path) -> None:
    plan, _ = plan_step_memory(build, batch_size=B, seq_len=S, optimizer="adamw_bnb_8bit", model_states=False)
    assert plan.step.problem is None
    [note] = [note for note in plan.step.notes if note.startswith("adamw_bnb_8bit: its constructor cannot run")]
    assert "aten._local_scalar_dense" in note
    rule = plan_model_states(build(), "adamw_bnb_8bit").optimizers[0].optimizer_state_bytes
    assert plan.step.peak_parts["optimizer_state"] == rule == real_state_bytes(tmp_path)
    assert plan.step.optimizer_step_peak_bytes is None
    assert plan.step.peak_bytes == plan.step.forward_backward_peak_bytes
    # The rule's state is in the peak, not only in its parts: they sum to it.
    assert sum(plan.step.peak_parts.values()) == plan.step.peak_bytes
    no_optimizer, _ = plan_step_memory(build, batch_size=B, seq_len=S, optimizer="sgd", model_states=False)
    assert plan.step.activations_bytes == no_optimizer.step.activations_bytes
