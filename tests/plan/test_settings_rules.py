"""`resolve_settings` reads each value with the rules of the code that reads it in a run, and
refuses what that code would refuse or misread: `SettingsFileError` for a file's value, a plain
`ValueError` for a flag's."""

from __future__ import annotations

import json
import math

import pytest

from trainer_memcb.plan.settings import SettingsFileError, resolve_settings


@pytest.mark.parametrize("args,phrase", [
    ({"per_device_train_batchsize": 4}, "'per_device_train_batchsize' is not a TrainingArguments field "
                                        "(TrainingArguments(**args) raises TypeError); did you mean "
                                        "'per_device_train_batch_size'?"),
    ({"bf16": True, "fp16": True}, "bf16 and fp16 are both true"),
    ({"gradient_accumulation_steps": 0}, "gradient_accumulation_steps=0: expected a whole number of at least 1"),
    ({"gradient_checkpointing": "false"}, "gradient_checkpointing='false' is a string: TrainingArguments keeps it "
                                          "as given and the Trainer takes any non-empty string as true"),
    ({"ddp_bucket_cap_mb": -3}, "ddp_bucket_cap_mb=-3: expected a finite number of megabytes above 0"),
    ({"per_device_train_batch_size": 0}, "per_device_train_batch_size=0: expected a whole number of at least 1"),
    ({"gradient_checkpointing_kwargs": {"use_reentrant": "false"}},
     "gradient_checkpointing_kwargs: use_reentrant='false': expected true or false"),
    ({"gradient_checkpointing_kwargs": "{use_reentrant: false}"},
     "gradient_checkpointing_kwargs='{use_reentrant: false}' is neither a JSON object nor a dict"),
    ({"gradient_checkpointing_kwargs": "[1]"}, "gradient_checkpointing_kwargs=[1]: expected a dict of keywords"),
])
def test_training_args_the_trainer_would_refuse_or_misread_are_refused(args, phrase, tmp_path) -> None:
    with pytest.raises(SettingsFileError, match="^training args: ") as caught:
        resolve_settings(args)
    assert phrase in str(caught.value)
    path = tmp_path / "args.json"
    path.write_text(json.dumps(args))
    with pytest.raises(SettingsFileError) as caught:
        resolve_settings(str(path))
    assert phrase in str(caught.value)


@pytest.mark.parametrize("deepspeed,phrase", [
    ({"bf16": {"enabled": True}, "fp16": {"enabled": True}}, "bf16.enabled and fp16.enabled are both true"),
    ({"gradient_accumulation_steps": 0}, "gradient_accumulation_steps=0: expected a whole number of at least 1"),
    ({"train_micro_batch_size_per_gpu": 0}, "train_micro_batch_size_per_gpu=0: expected a whole number of at least 1"),
    ({"zero_optimization": {"stage": 2, "reduce_bucket_size": -5}},
     "zero_optimization.reduce_bucket_size=-5: expected a whole number of at least 1"),
    ({"zero_optimization": {"stage": 2, "reduce_bucket_size": 0}},
     "zero_optimization.reduce_bucket_size=0: expected a whole number of at least 1"),
    ({"zero_optimization": {"stage": 2, "allgather_bucket_size": math.nan}},
     "zero_optimization.allgather_bucket_size=nan: expected a whole number of at least 0"),
    ({"zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 1.5}},
     "zero_optimization.stage3_prefetch_bucket_size=1.5: expected a whole number of at least 0"),
])
def test_deepspeed_values_deepspeed_would_refuse_are_refused(deepspeed, phrase) -> None:
    with pytest.raises(SettingsFileError, match="^deepspeed config: ") as caught:
        resolve_settings(deepspeed=dict(deepspeed, zero_optimization=deepspeed.get("zero_optimization", {"stage": 2})),
                         world_size=2)
    assert phrase in str(caught.value)


def test_deepspeed_sizes_it_accepts_are_kept() -> None:
    # 5e8 is a whole number (DeepSpeed's pp_int defaults are written so); 0 allowed where the field has ge=0.
    settings = resolve_settings(deepspeed={"zero_optimization": {"stage": 2, "reduce_bucket_size": 5e8,
                                                                 "allgather_bucket_size": 0}}, world_size=2)
    assert (settings.zero["reduce_bucket_size"], settings.zero["allgather_bucket_size"]) == (5e8, 0)


@pytest.mark.parametrize("value,reshard", [("yes", True), (1, True), ("TRUE", True), (True, True), ("on", True),
                                           ("no", False), (0, False), ("false", False), (False, False)])
def test_fsdp_booleans_are_read_with_the_trainers_str_to_bool(value, reshard) -> None:
    settings = resolve_settings(fsdp_config={"reshard_after_forward": value, "activation_checkpointing": value},
                                world_size=4)
    assert (settings.reshard_after_forward, settings.gradient_checkpointing) == (reshard, reshard)
    assert settings.sharding == ("fsdp-full-shard" if reshard else "fsdp-shard-grad-op")


def test_an_fsdp_boolean_str_to_bool_cannot_read_is_refused() -> None:
    with pytest.raises(SettingsFileError, match="reshard_after_forward='full_shard': the Trainer reads it with "
                                                "str_to_bool, which takes y/yes/t/true/on/1"):
        resolve_settings(fsdp_config={"reshard_after_forward": "full_shard"}, world_size=4)


@pytest.mark.parametrize("cpu_offload,offloaded", [(1, True), ("yes", True), (0, False), (False, False)])
def test_fsdp_cpu_offload_is_any_true_value_as_the_trainer_tests_it(cpu_offload, offloaded) -> None:
    # TrainingArguments._process_fsdp_args: `if self.fsdp_config.get("cpu_offload", False)`.
    assert resolve_settings(fsdp_config={"cpu_offload": cpu_offload}, world_size=4).fsdp_cpu_offload is offloaded


@pytest.mark.parametrize("cap", [math.nan, -1.0, 0.0, math.inf])
def test_a_flags_bad_bucket_size_is_a_plain_value_error(cap) -> None:
    with pytest.raises(ValueError, match=r"^--bucket-cap-mb .*: expected a finite number of megabytes above 0") as caught:
        resolve_settings(bucket_cap_mb=cap, world_size=2, sharding="ddp")
    assert not isinstance(caught.value, SettingsFileError)


@pytest.mark.parametrize("given", [{"use_reentrant": True}, '{"use_reentrant": true}'])
def test_checkpointing_keywords_are_read_as_training_arguments_reads_them(given, tmp_path) -> None:
    # TrainingArguments parses a string of JSON into the dict (its `_VALID_DICT_FIELDS`).
    path = tmp_path / "args.json"
    path.write_text(json.dumps({"gradient_checkpointing": True, "gradient_checkpointing_kwargs": given}))
    settings = resolve_settings(str(path))
    assert settings.checkpointing_kwargs == {"use_reentrant": True}
    assert settings.sources["checkpointing_kwargs"] == "training args"
    assert ("checkpointing_kwargs", {"use_reentrant": True}, "training args") in settings.used()
    assert resolve_settings({"gradient_checkpointing": True}).checkpointing_kwargs is None


def test_liger_kernel_settings_are_read_as_the_trainer_reads_them(tmp_path) -> None:
    from transformers import TrainingArguments

    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_liger_kernel=True,
                             liger_kernel_config={"rope": False})
    settings = resolve_settings(args)
    assert (settings.use_liger_kernel, settings.liger_kernel_config) == (True, {"rope": False})
    assert settings.sources["use_liger_kernel"] == settings.sources["liger_kernel_config"] == "training args"
    # A JSON string, as TrainingArguments parses one; a flag over the file wins.
    settings = resolve_settings({"use_liger_kernel": True, "liger_kernel_config": '{"swiglu": false}'},
                                liger_kernel_config={"rope": False})
    assert (settings.liger_kernel_config, settings.sources["liger_kernel_config"]) == ({"rope": False}, "flag")
    # The Trainer reads the config only with use_liger_kernel: without it, nothing is set, a bad one included.
    off = resolve_settings({"use_liger_kernel": False, "liger_kernel_config": {"rms_nrom": True}})
    assert (off.use_liger_kernel, off.liger_kernel_config) == (None, None)
    with pytest.raises(SettingsFileError, match="'rms_nrom' is not a keyword of liger-kernel's apply functions"):
        resolve_settings({"use_liger_kernel": True, "liger_kernel_config": {"rms_nrom": True}})
    # The same value given as a flag: a plain ValueError.
    with pytest.raises(ValueError, match="cannot both be true") as refused:
        resolve_settings(use_liger_kernel=True, liger_kernel_config={"cross_entropy": True})
    assert type(refused.value) is ValueError


def test_liger_kernels_fused_loss_with_trls_dpo_step_is_refused_as_trl_refuses_it() -> None:
    from trainer_memcb.plan.step.preference import DpoStep

    with pytest.raises(ValueError, match="with TRL's DPO step: TRL refuses it"):
        resolve_settings(use_liger_kernel=True, liger_kernel_config={"fused_linear_cross_entropy": True},
                         preference=DpoStep(), batch_size=1)
    assert resolve_settings(use_liger_kernel=True, preference=DpoStep(), batch_size=1).use_liger_kernel
