"""TRL's SFT step under context parallelism (`--trainer sft --parallelism cp=N`), and the steps of
TRL's trainers the plan refuses beside it, each refusal the trainer's own rule in one line.

Planned: SFT's padded rows (`SFTTrainer` with `packing=False`). The Trainer's
`_prepare_context_parallel_inputs` (transformers 5.25) adds `shift_labels` and `position_ids` and
shards `input_ids`, `labels`, `shift_labels`, the 2-D `attention_mask` and `position_ids` on the
sequence; TRL 1.16's fused LM head (`add_fused_lm_head`) then scores the rank's `shift_labels`
without shifting, so each rank's head runs on its `B x L / cp` tokens (not `B x (L - 1)`): its
`ChunkedLogProbFunction` holds a `[B x L / cp, 32,768]` tile (`_CHUNKED_LOGPROB_CHUNK_SIZE` columns,
whatever the vocabulary) in the weights' dtype.

Not checked against a real run: torch's ring does not run on this CPU (tests/plan/test_context_parallel.py
holds that); the sizes below are derived by hand from the sources named, recorded from the plan's
own trace (a dispatch mode that lists the storages TRL's kernel makes, and the fused head's outputs
as `compute_loss` reads them).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

from helpers import requires_torch, requires_version

from trainer_memcb.plan.answers.step_memory import plan_step_memory
from trainer_memcb.plan.settings import resolve_settings

sys.path.insert(0, os.path.dirname(__file__))
from test_context_parallel import RING, _NewStorages  # noqa: E402
from test_engines import build  # noqa: E402

pytestmark = requires_version("trl", "1.16", "SFTTrainer's fused LM head (add_fused_lm_head), whose step is planned")
RING_AND_FSDP2 = RING + " and the fake process group's collectives that FSDP2 runs"

# tests/plan/test_engines.py's tiny Llama (hidden 64, vocabulary 256), two rows of 64 tokens, bf16.
BATCH, SEQ, CP = 2, 64, 2


def _settings(step, rank=0, **more):
    return resolve_settings(**dict(dict(parallelism=f"cp={CP}", rank=rank, batch_size=BATCH, seq_len=SEQ,
                                        optimizer="adamw_torch", precision="bf16", preference=step), **more))


def _plan(step, rank=0):
    plan, _ = plan_step_memory(build, seq_len=SEQ, settings=_settings(step, rank), device_type="cuda",
                               model_states=False)
    assert plan.step.problem is None, plan.step.problem
    assert plan.settings.engine == "cp-fsdp2"
    return plan.step


# -- refused: each trainer's own rule ---------------------------------------------------------------

def _refused_steps():
    from trainer_memcb.plan.step.grpo import GrpoStep
    from trainer_memcb.plan.step.kto import KtoStep
    from trainer_memcb.plan.step.preference import DpoStep
    from trainer_memcb.plan.step.rloo import RlooStep
    from trainer_memcb.plan.step.sft import SftStep

    return {
        # trl/trainer/sft_trainer.py, SFTTrainer.__init__: packing with `cp_enabled` raises.
        "sft packing": (SftStep(max_length=SEQ, padding_free=True), dict(batch_size=1, packing=BATCH * SEQ),
                        "TRL's SFTTrainer refuses packing with context parallelism (\"context parallelism drops that "
                        "mask, so documents would attend across their boundaries\"); give packing and eval_packing "
                        "false"),
        # The same rule reads eval_packing (`args.packing or args.eval_packing`), whatever the training rows.
        "sft eval packing": (SftStep(max_length=SEQ, eval_packing=True), {}, "TRL's SFTTrainer refuses packing with "
                             "context parallelism"),
        # trl/trainer/grpo_config.py and rloo_config.py, __post_init__: `cp_enabled` raises.
        "grpo": (GrpoStep(), {}, "TRL's GRPOConfig refuses cp_size > 1 (\"GRPO builds model inputs after generation"),
        "rloo": (RlooStep(), {}, "TRL's RLOOConfig refuses cp_size > 1 (\"RLOO builds model inputs after generation"),
        # The Trainer shards input_ids but not completion_mask: DPOTrainer._compute_loss's masked_fill
        # meets [B, L / cp] against [B, L].
        "dpo": (DpoStep(), {}, "TRL's DPO batch has no labels and keeps completion_mask whole (the Trainer shards "
                               "only input_ids, labels, shift_labels, attention_mask, position_ids): DPOTrainer's "
                               "input_ids.masked_fill(completion_mask == 0, -100) meets L / cp tokens against L and "
                               "fails"),
        "kto": (KtoStep(), {}, "TRL's KTO batch keeps completion_mask and its KL rows (KL_input_ids, "
                               "KL_attention_mask, KL_completion_mask) whole"),
    }


@pytest.mark.parametrize("name", ["sft packing", "sft eval packing", "grpo", "rloo", "dpo", "kto"])
def test_a_trl_step_its_trainer_refuses_under_cp_is_one_line_naming_its_rule(name):
    step, shape, message = _refused_steps()[name]
    with pytest.raises(ValueError) as refused:
        _settings(step, **shape)
    text = str(refused.value)
    assert text.startswith("parallelism cp=2: ") and message in text and "\n" not in text


def test_the_dpo_step_s_own_line_fails_on_the_shares_the_trainer_leaves_it():
    # What the refusal names, run: the Trainer's shard of input_ids ([B, L / cp]) against the
    # unsharded completion_mask ([B, L]) in DPOTrainer._compute_loss's first line on them.
    input_ids, completion_mask = torch.zeros(BATCH, SEQ // CP, dtype=torch.long), torch.ones(BATCH, SEQ)
    with pytest.raises(RuntimeError, match="must match the size of tensor b"):
        input_ids.masked_fill(completion_mask == 0, -100)


# -- planned: SFT's padded rows --------------------------------------------------------------------

@pytest.fixture()
def recorded(monkeypatch):
    """The storages TRL's `ChunkedLogProbFunction.forward` and `.backward` make in the plan's trace
    (their inputs' left out), and the fused head's outputs and the batch as `SFTTrainer.compute_loss`
    reads them (`trainer_memcb.plan.step.sft._metrics`' arguments)."""
    from trl.kernels.chunked_logprob import ChunkedLogProbFunction

    import trainer_memcb.plan.step.sft as sft

    seen = {}
    forward, backward, metrics = ChunkedLogProbFunction.forward, ChunkedLogProbFunction.backward, sft._metrics

    def recorded_forward(ctx, hidden, weight, bias, targets, *args):
        from torch.distributed.tensor import DTensor

        seen["head"] = (tuple(hidden.shape), tuple(targets.shape))
        seen["weight"] = (isinstance(weight, DTensor), tuple(weight.shape))
        with _NewStorages([hidden, weight, targets]) as made:
            out = forward(ctx, hidden, weight, bias, targets, *args)
        seen["forward"] = made.made
        return out

    def recorded_backward(ctx, *grads):
        with _NewStorages([t for t in list(ctx.saved_tensors) + list(grads) if t is not None]) as made:
            out = backward(ctx, *grads)
        seen["backward"] = made.made
        return out

    def recorded_metrics(outputs, batch):
        fields = {name: getattr(outputs, name) for name in ("log_probs", "entropy", "is_top1", "label_mask")}
        seen["outputs"] = {name: (tuple(value.shape), value.untyped_storage().nbytes())
                           for name, value in fields.items()}
        seen["batch"] = {name: (tuple(value.shape), value.untyped_storage().nbytes())
                         for name, value in batch.items() if isinstance(value, torch.Tensor)}
        return metrics(outputs, batch)

    monkeypatch.setattr(ChunkedLogProbFunction, "forward", staticmethod(recorded_forward))
    monkeypatch.setattr(ChunkedLogProbFunction, "backward", staticmethod(recorded_backward))
    monkeypatch.setattr(sft, "_metrics", recorded_metrics)
    return seen


# TRL's tile: `_CHUNKED_LOGPROB_CHUNK_SIZE` (32,768) columns for each of the rank's tokens, bf16.
TILE = BATCH * SEQ // CP * 32_768 * 2


@requires_torch("2.13", RING_AND_FSDP2)
def test_each_rank_s_fused_head_scores_its_share_of_the_tokens(recorded):
    from trainer_memcb.plan.step.sft import SftStep

    _plan(SftStep(max_length=SEQ))
    share = SEQ // CP  # 32 tokens a row on each rank
    # The Trainer's buffers, sharded in place (`resize_` keeps each [2, 64] int64 storage, 1,024
    # bytes; position_ids' `arange(64)`, 512), shift_labels among them: TRL's collator gives none.
    assert recorded["batch"] == {"input_ids": ((BATCH, share), 1_024), "attention_mask": ((BATCH, share), 1_024),
                                 "labels": ((BATCH, share), 1_024), "shift_labels": ((BATCH, share), 1_024),
                                 "position_ids": ((BATCH, share), 512)}
    # With shift_labels the head takes the backbone's whole share unshifted: 2 x 32 = 64 rows of 64.
    assert recorded["head"] == ((BATCH * share, 64), (BATCH * share,))
    # FSDP2's root group (the head is the root's) is unsharded for the forward: the whole [256, 64]
    # head as a plain tensor, so TRL's `full_tensor()` gather is not taken.
    assert recorded["weight"] == (False, (256, 64))
    # ChunkedLogProbFunction.forward: seven [64] float32 statistics (running_max, sum_exp, x_sum_exp,
    # sq_sum_exp, z_sum, max_before_target, target_logit: 256 bytes each), then mm_buf
    # [min(64, 4,096), 32,768] bf16.
    assert recorded["forward"][:8] == [("full", 256)] + [("zeros", 256)] * 4 + [("full", 256), ("zeros", 256),
                                                                                ("empty", TILE)]
    # Its backward: grad_hidden [64, 64] and grad_weight [256, 64] float32 zeros, mm_buf again.
    assert recorded["backward"][:3] == [("zeros", 16_384), ("zeros", 65_536), ("empty", TILE)]
    # compute_loss's outputs, per position of the rank's [2, 32]: float32 log-probs and entropy, bool
    # top-1 and label mask.
    assert recorded["outputs"] == {"log_probs": ((BATCH, share), 256), "entropy": ((BATCH, share), 256),
                                   "is_top1": ((BATCH, share), 64), "label_mask": ((BATCH, share), 64)}


@requires_torch("2.13", RING_AND_FSDP2)
def test_each_rank_s_sft_step_under_cp():
    from trainer_memcb.plan.step.sft import SftStep

    rank0, rank1 = _plan(SftStep(max_length=SEQ)), _plan(SftStep(max_length=SEQ), rank=1)
    for step in (rank0, rank1):
        # As tests/plan/test_context_parallel.py's plain step: half the model (FSDP2 over the cp
        # ranks), the buffers of `recorded` above and the rotary buffers (64 bytes).
        assert step.peak_parts["parameters"] == 115_008
        assert step.peak_parts["batch_and_buffers"] == 3 * 1_024 + 512 + 64
        # The peak is in the fused head's backward, its tile alive.
        assert step.peak_phase == "backward" and step.peak_parts["other"] > TILE
    # Rank 0's merged attention output is copied for o_proj, rank 1's is not (the plain step's
    # 2 layers x 8,192 bytes, tests/plan/test_context_parallel.py).
    assert rank0.activations_bytes - rank1.activations_bytes == 2 * 8_192
    assert (rank0.peak_bytes, rank1.peak_bytes) == (5_634_576, 5_618_192)
    assert sum(rank0.peak_parts.values()) == rank0.peak_bytes
