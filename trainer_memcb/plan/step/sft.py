"""TRL's SFT step, as `SFTTrainer` (TRL 1.16) runs it, for the step tracer.

`SFTTrainer.compute_loss` (trl/trainer/sft_trainer.py) is what the Trainer's `training_step` runs
for each micro-batch; this module runs the same tensor operations under fake tensors:

- the batch `DataCollatorForLanguageModeling.torch_call` makes (`sft_batch`): `input_ids`,
  `labels` and `attention_mask`, each (B, max_length) int64, the Trainer's causal LM batch; or,
  padding-free (`padding_free`, or `packing` with the "bfd" strategies), the micro-batch's
  sequences flattened into one row: `input_ids`, `labels` and `position_ids` (1, TOKENS) int64,
  `cu_seq_lens_q` and `cu_seq_lens_k` (one int32 tensor of sequences + 1, the collator gives the
  same tensor twice), `max_length_q`, `max_length_k` (ints) and `seq_idx` (1, TOKENS) int32;
- the forward through TRL's own fused LM head (`trl.trainer.utils.add_fused_lm_head`, patched onto
  the fake model as `SFTTrainer.__init__` patches it, with the outputs it asks for: log-probs,
  entropy and top-1), which scores the positions in chunks without the (B, S, vocab) logits;
- the loss (`loss_type` "nll", or "dft": each token's loss weighted by its detached probability),
  summed and divided by `num_items_in_batch` (the Trainer's 0-dim fp32 count) clamped at 1;
- the metrics' tensors: the labelled tokens, the entropy's and the top-1's sums, their quotients
  (read by `.item()`, which frees them) and the batch's tokens.

Masked labels (`completion_only_loss`, `assistant_only_loss`) change no tensor's size: off Triton
(the CPU) TRL's head scores every position (`compact=False`); on CUDA its Triton kernel scores the
labelled positions only (`hidden_states[mask]`, a size the data decides), which this trace does not
do: it plans every position labelled, the most.

Under context parallelism (padded rows only: TRL refuses packing there) the engine shards the batch
as the Trainer does (`trainer_memcb.plan.step.engines.context_parallel`), adding `shift_labels`,
which the fused head scores unshifted: each rank's head runs on its `B x L / cp` tokens. With
several processes `compute_loss`'s `gather_for_metrics` all-gathers each 0-dim metric into a
tensor of the processes and sums it: temporaries freed before the backward, not traced.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Dict, Optional, Tuple

import torch

from trainer_memcb.plan.model.loss_kwargs import accepts_loss_kwargs, num_items_in_batch
from trainer_memcb.plan.model.step_inputs import step_inputs
from trainer_memcb.plan.step.trl_step import TrlStep

__all__ = ["SftStep", "SFT_LOSS_TYPES", "sft_step_from_config", "sft_batch", "sft_loss", "sft_fused_lm_head"]

# TRL 1.16's loss types (`SFTTrainer.__init__` refuses any other), each mirrored from `compute_loss`.
SFT_LOSS_TYPES = ("nll", "dft")
# The outputs `SFTTrainer.__init__` asks the fused head for (`is_top1` feeds mean_token_accuracy).
_OUTPUTS = ("log_probs", "entropy", "is_top1")


@dataclasses.dataclass(frozen=True)
class SftStep(TrlStep):
    """The SFT settings that change the step's memory.

    Attributes:
        loss_type: one of `SFT_LOSS_TYPES`.
        max_length: `SFTConfig.max_length`: every row's tokens at most.
        padding_free: the micro-batch flattened into one row (`padding_free`, or `packing` with
            the "bfd" or "bfd_split" strategy).
        average_tokens_across_devices: the `TrainingArguments` field: `compute_loss` then
            multiplies the loss by the processes (one here), a 0-dim tensor more.
        eval_packing: `SFTConfig.eval_packing` true: the evaluation's batches packed. It changes no
            training step, but `SFTTrainer.__init__` refuses it under context parallelism, as it
            refuses `packing` (`trainer_memcb.plan.settings.parallelism.check_context_parallel_step`).
    """

    loss_type: str = "nll"
    max_length: int = 1024
    padding_free: bool = False
    average_tokens_across_devices: bool = True
    eval_packing: bool = False
    trainer: str = dataclasses.field(default="sft", init=False)
    reference: str = dataclasses.field(default="none", init=False)

    def __post_init__(self) -> None:
        if self.loss_type not in SFT_LOSS_TYPES:
            raise ValueError(f"loss_type {self.loss_type!r}: TRL's SFTTrainer takes {', '.join(SFT_LOSS_TYPES)}")
        if isinstance(self.max_length, bool) or not isinstance(self.max_length, int) or self.max_length < 1:
            raise ValueError(f"max_length {self.max_length!r}: expected a whole number of tokens, at least 1")

    def fuse_lm_heads(self, model: torch.nn.Module, ref_model: Optional[torch.nn.Module]) -> None:
        sft_fused_lm_head(model)

    def batch(self, model: torch.nn.Module, batch_size: int, seq_len: Optional[int], input_options: Dict[str, Any]) -> Any:
        # SFT's collator: the causal LM batch, its padding-free row's boundaries.
        return sft_batch(step_inputs(model, batch_size, seq_len, **input_options), self, seq_len)

    def loss(self, model: torch.nn.Module, inputs: Any, ref_model: Optional[torch.nn.Module], kwargs: Dict[str, Any],
             accumulation: int, autocast: Any) -> torch.Tensor:
        # SFTTrainer.compute_loss: the fused head's loss and metrics; `num_items_in_batch` kept to
        # the step's end in `kwargs`, as the plain Trainer's.
        if accepts_loss_kwargs(model):
            kwargs["num_items_in_batch"] = num_items_in_batch(inputs.labels)
        with autocast if autocast is not None else contextlib.nullcontext():
            return sft_loss(model, inputs, self, kwargs.get("num_items_in_batch"))


def sft_step_from_config(config: Any) -> SftStep:
    """The `SftStep` of a `trl.SFTConfig`'s own fields (a namespace of them, or a config), after the
    checks `SFTConfig.__post_init__` and `SFTTrainer.__init__` make of the same fields for a text
    dataset and the trainer's own collator.

    Raises:
        ValueError: naming the field, its value and what TRL allows, or an option not planned.
    """
    loss_type = "nll" if config.loss_type == "chunked_nll" else config.loss_type  # __post_init__'s rename
    if loss_type not in SFT_LOSS_TYPES:
        raise ValueError(f"loss_type {config.loss_type!r}: TRL's SFTTrainer takes {', '.join(SFT_LOSS_TYPES)}")
    strategy = "bfd_split" if config.packing_strategy == "bfd-requeue" else config.packing_strategy
    if strategy not in ("bfd", "bfd_split", "wrapped"):
        raise ValueError(f"packing_strategy {config.packing_strategy!r}: TRL takes bfd, bfd_split, wrapped")
    padding_free = bool(config.padding_free) or (bool(config.packing) and strategy in ("bfd", "bfd_split"))
    if config.max_length is None:
        raise ValueError("max_length None: the SFT step is planned at max_length tokens a row; give one")
    if padding_free and not config.packing:
        raise ValueError("padding_free true without packing: TRL refuses it with a max_length (\"max_length is not "
                         "enforced\"); give packing true (strategy bfd) or padding_free false")
    if config.packing and strategy == "wrapped" and not padding_free:
        raise ValueError("packing true with packing_strategy 'wrapped': the SFT step is planned for bfd and bfd_split "
                         "packing (padding-free rows) so far")
    if config.activation_offloading:
        raise ValueError("activation_offloading true: the SFT step is planned without offloading activations "
                         "(its OffloadActivations hooks move saved tensors to the CPU by data-dependent rules)")
    if config.router_aux_loss_coef:
        raise ValueError(f"router_aux_loss_coef {config.router_aux_loss_coef!r}: the SFT step is planned without "
                         "a Mixture-of-Experts auxiliary loss")
    if config.pad_to_multiple_of not in (None, "auto", "none", "null"):
        raise ValueError(f"pad_to_multiple_of {config.pad_to_multiple_of!r}: the SFT step is planned at max_length "
                         "tokens unpadded ('auto' or null)")
    return SftStep(loss_type=loss_type, max_length=config.max_length, padding_free=padding_free,
                   eval_packing=bool(getattr(config, "eval_packing", None)))


def sft_fused_lm_head(model: torch.nn.Module) -> None:
    """Patch TRL's fused LM head onto the model (its base model under PEFT), as `SFTTrainer.__init__` does."""
    from trl.trainer.utils import add_fused_lm_head

    base = model.get_base_model() if hasattr(model, "get_base_model") and hasattr(model, "peft_config") else model
    add_fused_lm_head(base, outputs=_OUTPUTS)


def sft_batch(inputs: Any, step: SftStep, seq_len: int) -> Any:
    """The collator's batch from the Trainer's causal LM batch `inputs` (a `StepInputs`, made in the
    current mode; packed of `seq_len`-token sequences where padding-free): unchanged for rows;
    padding-free, the packed row with the boundaries and sequence index `DataCollatorForLanguageModeling`
    adds (module docstring), in place of flash's two."""
    from trainer_memcb.plan.model.step_inputs import packed_lengths

    if not step.padding_free:
        return inputs
    forward = {name: inputs.forward[name] for name in ("input_ids", "labels", "position_ids")}
    tokens = forward["input_ids"].size(1)
    lengths = packed_lengths(seq_len, tokens)
    bounds = [0]
    for length in lengths:
        bounds.append(bounds[-1] + length)
    forward["cu_seq_lens_q"] = forward["cu_seq_lens_k"] = torch.tensor(bounds, dtype=torch.int32)
    forward["max_length_q"] = forward["max_length_k"] = max(lengths)  # type: ignore[assignment]
    forward["seq_idx"] = torch.zeros(1, tokens, dtype=torch.int32)
    return dataclasses.replace(inputs, forward=forward)


def sft_loss(model: torch.nn.Module, inputs: Any, step: SftStep,
             num_items_in_batch: Optional[torch.Tensor]) -> torch.Tensor:
    """`SFTTrainer.compute_loss(model, inputs, num_items_in_batch=...)` for a text model without an
    auxiliary loss, label smoothing or `compute_loss_func`, its value reads left out. The comments
    name the lines of trl/trainer/sft_trainer.py (TRL 1.16) each part mirrors."""
    batch = dict(inputs.forward, use_cache=False)  # inputs["use_cache"] = False
    outputs = model(**batch, fused_lm_head=True)
    per_token_loss = -outputs.log_probs  # zero on ignored positions
    if step.loss_type == "dft":
        per_token_loss = per_token_loss * outputs.log_probs.exp().detach()
    num_tokens = outputs.label_mask.sum() if num_items_in_batch is None else num_items_in_batch
    loss = per_token_loss.sum() / torch.as_tensor(num_tokens).clamp(min=1)
    if step.average_tokens_across_devices and num_items_in_batch is not None:
        loss = loss * 1  # `* (num_processes // tp_size)`: one process
    kept = _metrics(outputs, batch)
    del kept, per_token_loss, outputs
    return loss


def _metrics(outputs: Any, batch: dict) -> Tuple[torch.Tensor, ...]:
    """The metrics' tensors of `compute_loss` ("# Entropy and token accuracy" to "num_tokens"), in
    its order: a single process's `gather_for_metrics` returns its input, each `.item()` frees the
    tensor it reads; the three sums stay alive (locals) to the function's end."""
    num_valid = outputs.label_mask.sum().sum()
    entropy_sum = outputs.entropy.detach().sum().sum()
    num_correct = outputs.is_top1.sum().sum()
    # (entropy_sum / num_valid).item() if num_valid > 0 else 0.0, then the accuracy's: each read, freed
    for numerator in (entropy_sum, num_correct):
        num_valid > 0
        numerator / num_valid
    if "attention_mask" in batch:
        batch["attention_mask"].sum().sum()  # num_tokens_in_batch, read
    else:
        ids = batch["position_ids"]
        torch.tensor(ids.size(1), device=ids.device).sum()  # local_num_tokens, gathered, read
    return num_valid, entropy_sum, num_correct
