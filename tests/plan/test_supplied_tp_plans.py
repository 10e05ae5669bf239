"""The tensor-parallel plans supplied for the encoders transformers gives none
(`trainer_memcb.plan.model.supplied_tp_plans`): what they name, where they are used and where not,
and a step planned with one, by hand count. Its real counterpart, a 2-process run that loads the
model with the same plan through transformers' own `from_pretrained`, is in
tests/training/test_tensor_parallel_runs.py."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from helpers import TRANSFORMERS_4, requires_torch, requires_transformers
from trainer_memcb.plan.model.supplied_tp_plans import SUPPLIED_TP_PLANS, supplied_tp_plan
from trainer_memcb.plan.model.tp_plan import model_tp_plan, plan_is_supplied

# The tiny BERT of the real run (tests/dist_scripts/engine_step_profile.py, engine tp-bert).
BERT = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, vocab_size=256,
            max_position_embeddings=64)


def _encoder(model_type: str) -> Any:
    """A tiny model with a classification head of each kind planned."""
    import transformers

    names = {"bert": "Bert", "roberta": "Roberta", "xlm-roberta": "XLMRoberta", "camembert": "Camembert",
             "electra": "Electra", "distilbert": "DistilBert"}
    config_class = getattr(transformers, f"{names[model_type]}Config")
    model_class = getattr(transformers, f"{names[model_type]}ForSequenceClassification")
    sizes = (dict(dim=64, n_layers=2, n_heads=4, hidden_dim=128, vocab_size=256) if model_type == "distilbert"
             else dict(BERT, embedding_size=64) if model_type == "electra" else BERT)
    with torch.device("meta"):
        return model_class(config_class(**sizes))


@requires_transformers("5.0", "transformers 5's encoders split their heads by the projection's width, so the plan runs")
@pytest.mark.parametrize("model_type", sorted(SUPPLIED_TP_PLANS))
def test_each_supplied_plan_names_two_linear_layers_of_each_block_by_columns_then_rows(model_type):
    model = _encoder(model_type)
    with pytest.raises(ValueError, match="has no tensor-parallel plan"):  # transformers gives none
        model_tp_plan(model, supplied=False)
    plan = model_tp_plan(model)
    assert plan == supplied_tp_plan(model) and plan_is_supplied(model)
    prefix = model.base_model_prefix + "."
    assert all(name.startswith(prefix) for name in plan)
    # Each entry names one linear layer in each of the 2 blocks.
    modules = dict(model.named_modules())
    for name in plan:
        matched = [module for module_name, module in modules.items()
                   if module_name in (name.replace("*", "0"), name.replace("*", "1"))]
        assert len(matched) == 2 and all(isinstance(module, torch.nn.Linear) for module in matched), name
    assert sorted(plan.values()) == ["colwise"] * 4 + ["rowwise"] * 2


@pytest.mark.skipif(not TRANSFORMERS_4, reason="transformers 4's encoders only: 5's take the supplied plan")
def test_on_transformers_4_none_is_supplied():
    # Its BERT splits heads by their configured number (`view(batch, -1, heads, head_size)`), which a
    # projection sharded by columns does not hold: the sequence would be split instead.
    model = _encoder("bert")
    assert supplied_tp_plan(model) is None and not plan_is_supplied(model)
    with pytest.raises(ValueError, match="BertForSequenceClassification has no tensor-parallel plan"):
        model_tp_plan(model)


@requires_transformers("5.0", "transformers 5's encoders split their heads by the projection's width, so the plan runs")
def test_the_user_s_rules_stand_alone_as_transformers_merges_them_over_no_plan():
    model = _encoder("bert")
    rules = {"bert.encoder.layer.*.intermediate.dense": "colwise", "bert.encoder.layer.*.output.dense": "rowwise"}
    assert model_tp_plan(model, rules) == rules and not plan_is_supplied(model, rules)


@requires_transformers("5.0", "transformers 5's encoders split their heads by the projection's width, so the plan runs")
def test_fit_proposes_no_tensor_parallelism_on_a_supplied_plan():
    # Its run needs the plan passed to from_pretrained by hand; the step plan of --parallelism says how.
    from trainer_memcb.cli.fit_table import tensor_parallel_sizes
    from trainer_memcb.plan.settings import resolve_settings

    assert tensor_parallel_sizes(_encoder("bert"), resolve_settings(world_size=2, batch_size=2)) == []


# One rank's values of the tiny BERT under tp=2, by hand: the embeddings whole (256 x 64 words, 64
# x 64 positions, 2 x 64 token types, a norm of 128), in each of 2 blocks query, key and value
# halved by rows with their biases (3 x (2,048 + 32)), the attention's output halved by columns
# beside its whole bias (2,048 + 64), the MLP's first layer by rows (4,096 + 64) and its second by
# columns (4,096 + 64), two norms (2 x 128); the pooler (4,160) and the head (130) whole.
BERT_TP2_VALUES = (16_384 + 4_096 + 128 + 128) + 2 * (3 * 2_080 + 2_112 + 4_160 + 4_160 + 2 * 128) + 4_160 + 130


def build_bert() -> torch.nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(**BERT)
    config._attn_implementation = "sdpa"
    with torch.device("meta"):
        return BertForSequenceClassification(config)


@requires_torch("2.13", "the fake process group's collectives that DTensor runs (tests/plan/test_engines.py)")
@requires_transformers("5.0", "transformers 5's encoders split their heads by the projection's width, so the plan runs")
def test_a_bert_step_under_tp2_holds_the_hand_counted_shards_and_says_whose_plan_it_is():
    from trainer_memcb.plan.answers.step_memory import plan_step_memory
    from trainer_memcb.plan.settings import resolve_settings

    settings = resolve_settings(parallelism="tp=2", rank=0, batch_size=16, optimizer="adamw_torch")
    plan, _ = plan_step_memory(build_bert, seq_len=64, settings=settings, device_type="cpu", model_states=False)
    states = plan.step.model_states_at_optimizer_step_bytes
    assert states["parameters"] == states["gradients"] == 4 * BERT_TP2_VALUES == 235_528
    assert plan.step.peak_bytes == 10_220_624  # the real run's peak less what its loading adds (its test)
    supplied = supplied_tp_plan(build_bert())
    assert plan.step.notes[1] == (
        "transformers gives BertForSequenceClassification no tp_plan: planned with trainer_memcb's (Megatron's split "
        "of each block, the rest whole on every rank), which a run applies as from_pretrained(..., "
        "distributed_config=DistributedConfig(tp_plan=PLAN, tp_size=N)), PLAN = "
        + json.dumps(supplied, separators=(",", ":")))
    assert json.loads(plan.step.notes[1].split("PLAN = ", 1)[1]) == supplied


@requires_torch("2.13", "the fake process group's collectives that DTensor and FSDP2 run (tests/plan/test_engines.py)")
@requires_transformers("5.0", "transformers 5's encoders split their heads by the projection's width, so the plan runs")
def test_beside_fsdp2_the_supplied_plan_s_shards_are_sharded_again_and_the_note_is_the_same():
    from trainer_memcb.plan.answers.step_memory import plan_step_memory
    from trainer_memcb.plan.settings import resolve_settings

    settings = resolve_settings(parallelism="tp=2,dp_shard=2", rank=0, batch_size=16, optimizer="adamw_torch")
    plan, _ = plan_step_memory(build_bert, seq_len=64, settings=settings, device_type="cpu", model_states=False)
    assert plan.settings.engine == "tp-fsdp2"
    states = plan.step.model_states_at_optimizer_step_bytes
    assert states["parameters"] == states["gradients"] == 4 * BERT_TP2_VALUES // 2 == 117_764
    [note] = [note for note in plan.step.notes if "no tp_plan" in note]
    assert note.startswith("transformers gives BertForSequenceClassification no tp_plan: planned with trainer_memcb's")
