"""torch's own `FSDPMemTracker` on the same fake FSDP2 step, as torchtitan's estimator runs it.

The model is made fake and sharded the way the plan does (`FSDP2Engine.wrap`: `fully_shard` on
each decoder layer and the root, on the fake process group); then two Trainer-like steps run
(forward with labels, backward, clipping, the Trainer's optimizer, `zero_grad(set_to_none=True)`),
the second under `FSDPMemTracker`, so that its peak includes the optimizer state a step after the
first holds, as the plan's does. The tracker's peak is read from its `get_tracker_snapshot("peak")`.
"""

from __future__ import annotations

from typing import Any, Callable, Dict

import torch


def fsdp_memtracker_peak(build_model: Callable[[], Any], settings: Any, batch_size: int, seq_len: int,
                         dtype: torch.dtype = torch.float32) -> Dict[str, int]:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from transformers import TrainingArguments

    from trainer_memcb.plan.step.engines.fsdp2 import FSDP2Engine
    from trainer_memcb.plan.model.loss_kwargs import num_items_in_batch
    from trainer_memcb.plan.step.trace import fake_copy
    from trainer_memcb.plan.model.trainer_model import prepare_like_trainer
    from trainer_memcb.plan.optimizers.trainer_optimizers import build_trainer_optimizer
    from trainer_memcb.plan.model.value_reads import unpadded_batch

    mode = FakeTensorMode()
    engine = FSDP2Engine(settings)
    try:
        model = fake_copy(build_model(), mode, "cpu", dtype)
        prepare_like_trainer(model)  # use_cache=False and training mode, as the Trainer and the plan
        model = engine.wrap(model, mode)
        args = TrainingArguments(output_dir="fsdp-reference", report_to=[])
        with mode:
            optimizer = build_trainer_optimizer(settings.optimizer, args, model)
            input_ids = torch.zeros(batch_size, seq_len, dtype=torch.long)
            labels = torch.zeros(batch_size, seq_len, dtype=torch.long)
            mask = torch.ones(batch_size, seq_len, dtype=torch.long)  # the collator's, unpadded
            trainable = [p for p in model.parameters() if p.requires_grad]

            def step() -> None:
                with unpadded_batch():  # transformers' all-ones mask checks, answered as for a real batch
                    loss = model(input_ids=input_ids, attention_mask=mask, labels=labels,
                                 num_items_in_batch=num_items_in_batch(labels)).loss
                loss.backward()
                del loss
                torch.nn.utils.clip_grad_norm_(trainable, settings.max_grad_norm)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)

            step()
            tracker = FSDPMemTracker(mod=model, optm=optimizer)
            tracker.track_inputs((input_ids, mask, labels))
            with tracker:
                step()
        snapshot = tracker.get_tracker_snapshot("peak")
        (device_stats,) = snapshot[model].values() if model in snapshot else snapshot.values()
        return {str(key): int(value) for key, value in device_stats.items()}
    finally:
        engine.close()
