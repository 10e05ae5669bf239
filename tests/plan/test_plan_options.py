"""The plan takes every option the what-if takes (optim_args, optim_target_modules, LoRA, every
optimizer name) and agrees with it to the byte in one process; LOMO, AdaLomo and the layer-wise
optimizers hold one gradient; rows and notes that say why; a parameter count as MODEL."""

from __future__ import annotations

import doctest
import importlib.util
import json
import os

import pytest

from helpers import installed_version, requires_transformers

import trainer_memcb.cli.estimate_asked
import trainer_memcb.plan.optimizers.update_kinds
from trainer_memcb.cli import main
from trainer_memcb.cli.estimate_asked import parameter_count
from trainer_memcb.plan.answers.model_states import plan_model_states
from trainer_memcb.plan.settings.setup import Setup
from trainer_memcb.plan.answers.sharding import zero12_partition_numel
from trainer_memcb.plan.optimizers.whatif import build_meta_model, optimizer_names, resolve_optimizer_names, what_if

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(REPO_ROOT, "examples", "models", "tiny-distilbert")
LLAMA = os.path.join(REPO_ROOT, "examples", "models", "llama-2-7b")
# tiny-distilbert: 454,530 parameter values in 40 tensors (dim 128, 2 layers, vocabulary 256).
TINY_VALUES = 454_530
# GaLore and APOLLO need target modules: the attention and feed-forward linears.
TARGETS = ".*(attention|ffn).*"


def load_references():
    spec = importlib.util.spec_from_file_location("references", os.path.join(REPO_ROOT, "benchmarks", "references.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tiny():
    return build_meta_model(TINY)


@pytest.mark.parametrize("module", [trainer_memcb.plan.optimizers.update_kinds, trainer_memcb.cli.estimate_asked])
def test_docstring_examples_run(module):
    result = doctest.testmod(module)
    assert result.attempted >= 1 and result.failed == 0


def figures(entries, attribute):
    return {entry.name: attribute(entry) for entry in entries}


def test_the_plan_in_one_process_equals_the_what_if_for_every_optimizer_name(tiny):
    names = resolve_optimizer_names(optimizer_names())
    result = what_if(tiny, names, optim_target_modules=TARGETS)
    plan = plan_model_states(tiny, names, Setup(), optim_target_modules=TARGETS)
    ours = figures(plan.optimizers, lambda entry: entry.optimizer_state_bytes)
    theirs = figures(result.optimizers, lambda entry: entry.estimate.num_bytes if entry.estimate else None)
    assert ours == theirs
    # The rows without a figure give the what-if's reason (a package missing, CUDA, the Trainer).
    assert figures(plan.optimizers, lambda entry: entry.problem) == figures(result.optimizers, lambda entry: entry.problem)
    planned = {name for name, num_bytes in ours.items() if num_bytes is not None}
    # The kinds the plan refused before, all built here from the test extra's libraries.
    assert {"galore_adamw", "galore_adamw_layerwise", "galore_adamw_8bit", "apollo_adamw", "apollo_adamw_layerwise",
            "lomo", "sgd", "adafactor", "adamw_torch", "adamw_bnb_8bit", "adamw_torch_8bit"} <= planned
    assert ours["lomo"] == 0 and ours["adamw_torch"] == 2 * 4 * TINY_VALUES + 4 * 40


def trainers_sgd_momentum(optim_args: str) -> float:
    """The momentum of the SGD a real Trainer builds with `optim_args` (transformers 5's `_get_sgd`
    reads it; 4.57's `get_optimizer_cls_and_kwargs` gives SGD the learning rate alone)."""
    import transformers

    from helpers import scratch_folder, training_args

    model = transformers.AutoModelForMaskedLM.from_config(transformers.AutoConfig.from_pretrained(TINY))
    trainer = transformers.Trainer(model=model, args=training_args(scratch_folder("unused-output"), optim="sgd", optim_args=optim_args))
    return trainer.create_optimizer().param_groups[0]["momentum"]


def test_optim_args_reach_the_plan_in_every_sharding_as_the_trainer_reads_them(tiny):
    # torch SGD with momentum: one fp32 momentum buffer per value, 4 x 454,530 bytes; without, none.
    # The installed Trainer decides: 0.9 on transformers 5, 0 on 4.57 (which passes SGD no optim_args).
    momentum = trainers_sgd_momentum("momentum=0.9")
    assert momentum == (0.9 if installed_version("transformers") >= (5,) else 0)
    assert 4 * TINY_VALUES == 1_818_120
    expected = 1_818_120 if momentum else 0
    (entry,) = what_if(tiny, "sgd", optim_args="momentum=0.9").optimizers
    assert entry.estimate.num_bytes == expected
    for setup in (Setup(), Setup(world_size=2, sharding="ddp")):
        (row,) = plan_model_states(tiny, "sgd", setup, optim_args="momentum=0.9").optimizers
        assert row.optimizer_state_bytes == expected
    (zero2,) = plan_model_states(tiny, "sgd", Setup(world_size=2, sharding="zero2"), optim_args="momentum=0.9").optimizers
    partition = zero12_partition_numel([TINY_VALUES], 2)
    assert partition == 227_266  # 454,530 padded to a multiple of 2 x 2, halved
    assert zero2.optimizer_state_bytes == (4 * partition if momentum else 0)
    (no_momentum,) = plan_model_states(tiny, "sgd", Setup(world_size=2, sharding="ddp")).optimizers
    assert no_momentum.optimizer_state_bytes == 0


def test_galore_and_apollo_take_their_target_modules_and_say_where_they_are_not_planned(tiny):
    names = ["galore_adamw", "apollo_adamw"]
    expected = figures(what_if(tiny, names, optim_target_modules=TARGETS).optimizers, lambda e: e.estimate.num_bytes)
    ddp = plan_model_states(tiny, names, Setup(world_size=4, sharding="ddp"), optim_target_modules=TARGETS)
    assert figures(ddp.optimizers, lambda entry: entry.optimizer_state_bytes) == expected
    zero = plan_model_states(tiny, names, Setup(world_size=4, sharding="zero2"), optim_target_modules=TARGETS)
    fsdp = plan_model_states(tiny, names, Setup(world_size=4, sharding="fsdp-full-shard"), optim_target_modules=TARGETS)
    for entry in zero.optimizers:
        assert entry.optimizer_state_bytes is None
        assert entry.problem == ("GaLore and APOLLO project whole 2-D weights; DeepSpeed hands the optimizer flat fp32 "
                                 "copies instead: plan it with --sharding none or ddp")
    for entry in fsdp.optimizers:
        assert entry.optimizer_state_bytes is None and "under FSDP the optimizer steps over row shards" in entry.problem
    # Without target modules, the Trainer's own refusal, in the plan as in the what-if.
    (plain,) = plan_model_states(tiny, "galore_adamw", Setup()).optimizers
    assert "You need to define `optim_target_modules`" in plain.problem


def test_layerwise_optimizers_over_several_processes_are_refused_as_the_trainer_refuses_them(tiny):
    plan = plan_model_states(tiny, "galore_adamw_layerwise", Setup(world_size=2, sharding="ddp"),
                             optim_target_modules=TARGETS)
    (entry,) = plan.optimizers
    assert entry.optimizer_state_bytes is None and entry.problem.startswith("the Trainer refuses layer-wise optimizers")
    # Not planned: no claim about its gradients beyond a plain optimizer's, and no note.
    assert (entry.grads_bytes, entry.updates_in_backward, plan.notes) == (4 * TINY_VALUES, False, [])
    (lomo,) = plan_model_states(tiny, "lomo", Setup(world_size=2, sharding="ddp")).optimizers
    assert lomo.problem.startswith("LOMO and AdaLomo are planned in one process")


def test_an_update_inside_backward_holds_one_gradient_the_largest(tiny):
    plan = plan_model_states(tiny, ["adamw", "lomo", "galore_adamw_layerwise"], Setup(), optim_target_modules=TARGETS)
    adamw, lomo, layerwise = plan.optimizers
    # The largest tensors of tiny-distilbert are the feed-forward's 512 x 128 weights (the word
    # embedding is 256 x 128), in float32; the first of them is named.
    assert adamw.grads_bytes == 4 * TINY_VALUES and not adamw.updates_in_backward
    assert lomo.grads_bytes == layerwise.grads_bytes == 512 * 128 * 4 == 262_144
    assert lomo.updates_in_backward and layerwise.updates_in_backward
    assert lomo.model_states_bytes == 4 * TINY_VALUES + 262_144 + 0
    assert plan.notes == ["gradients of lomo, galore_adamw_layerwise: updated inside backward one parameter at a time, "
                          "so one gradient at a time, the largest parameter's, distilbert.transformer.layer.0.ffn.lin1."
                          "weight, in its dtype"]


def test_lomo_table_1_gradients_for_llama_7b_in_fp16():
    row = load_references().lomo_row()
    # LOMO (Lv et al. 2023), Table 1, LLaMA-7B in fp16: 12.55 GB of parameters, 0.24 GB of
    # gradients (one fp16 gradient, the 32000 x 4096 embedding's), no optimizer state.
    assert row["ours"] == {"params_bytes": 13_476_831_232, "grads_bytes": 262_144_000, "optimizer_state_bytes": 0}
    assert 32_000 * 4_096 * 2 == 262_144_000
    assert row["largest"] == "model.embed_tokens.weight"
    assert row["printed"] == {"params_bytes": "12.55", "grads_bytes": "0.24", "optimizer_state_bytes": "0.00"}
    assert {key: f"{value / 2**30:.2f}" for key, value in row["ours"].items()} == row["printed"]


def test_zero_notes_where_the_fp32_master_weights_of_an_fp32_run_come_from(tiny):
    note = plan_model_states(tiny, "adamw", Setup(world_size=2, sharding="zero2")).notes
    assert len(note) == 1 and note[0].startswith("master weights: ZeRO gives the optimizer an fp32 copy")
    (entry,) = plan_model_states(tiny, "adamw", Setup(world_size=2, sharding="zero2")).optimizers
    assert entry.master_weights_bytes == 4 * zero12_partition_numel([TINY_VALUES], 2) == 909_064
    assert plan_model_states(tiny, "adamw", Setup(world_size=2, sharding="zero3")).notes == note
    # With DeepSpeed's mixed precision the copy is the point of it; without ZeRO there is none.
    assert plan_model_states(tiny, "adamw", Setup(world_size=2, sharding="zero2", precision="deepspeed-bf16")).notes == []
    assert plan_model_states(tiny, "adamw", Setup(world_size=2, sharding="ddp")).notes == []


@requires_transformers("5.0", "with transformers 4.x the plan's bfloat16 LoRA row counts no gradient for the float32 "
                       "adapters yet (0 against 16,777,216 bytes)")
def test_the_cli_plan_with_lora_in_bfloat16_equals_the_what_if(capsys):
    base = ["estimate", LLAMA, "--dtype", "bfloat16", "--lora-r", "8", "--lora-target-modules", "q_proj,v_proj",
            "--optimizers", "adamw,sgd", "--optim-args", "momentum=0.9", "--json"]
    assert main(base) == 0
    result = json.loads(capsys.readouterr().out)
    assert main(base + ["--world-size", "1"]) == 0
    plan = json.loads(capsys.readouterr().out)
    # 128 adapter matrices (A and B on q_proj and v_proj in 32 layers) of 8 x 4096 values, float32
    # over the bfloat16 base (PEFT's choice), as in the run.
    assert result["trainable_params"] == plan["trainable_params"] == 128 * 8 * 4096 == 4_194_304
    assert [entry["estimate"]["num_bytes"] for entry in result["optimizers"]] == [
        entry["optimizer_state_bytes"] for entry in plan["optimizers"]] == [8 * 4_194_304 + 4 * 128, 4 * 4_194_304]
    assert plan["setup"]["precision"] == "bf16"
    assert [entry["grads_bytes"] for entry in plan["optimizers"]] == [4 * 4_194_304] * 2


def test_parameter_counts_as_model():
    assert parameter_count("7500000000") == parameter_count("7.5e9") == parameter_count("7_500_000_000") == 7_500_000_000
    assert parameter_count("7,500,000,000") == 7_500_000_000
    assert parameter_count(TINY) is None and parameter_count("meta-llama/Llama-2-7b-hf") is None
    for bad in ("1.5", "0", "7.25e0"):
        with pytest.raises(ValueError, match=f"MODEL '{bad}' is not a whole parameter count of at least 1"):
            parameter_count(bad)


@pytest.mark.parametrize("argv, message", [
    (["7.5e9"], "trainer-memcb: error: a parameter count (7,500,000,000) answers the model-states plan only: "
                "add --world-size, --zero, --sharding or --precision"),
    (["7.5e9", "--zero", "1", "--lora-r", "8"], "trainer-memcb: error: --lora-r needs a model's modules and names"),
    (["7.5e9", "--zero", "1", "--optim-target-modules", "attn"],
     "trainer-memcb: error: --optim-target-modules needs a model's modules and names"),
    (["2.5", "--zero", "1"], "trainer-memcb: error: MODEL '2.5' is not a whole parameter count"),
])
def test_a_count_answers_in_one_line_what_it_cannot(argv, message, capsys):
    assert main(["estimate", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("\n") == 1


def test_a_count_plans_as_the_python_api_does(capsys):
    assert main(["estimate", "7.5e9", "--zero", "3", "--world-size", "64", "--precision", "deepspeed-fp16",
                 "--optimizers", "adamw", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    (expected,) = plan_model_states(7_500_000_000, "adamw", Setup(world_size=64, sharding="zero3",
                                                                   precision="deepspeed-fp16")).optimizers
    assert plan["model"] == "7,500,000,000 parameters" and plan["total_params"] == 7_500_000_000
    assert plan["optimizers"][0] == json.loads(json.dumps(expected.to_dict()))
