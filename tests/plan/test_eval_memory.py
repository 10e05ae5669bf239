"""The evaluation plan: its forward's peak against torch.profiler's live bytes of a real evaluation
batch, and the containers' arithmetic on settings a real run is not needed for."""

from __future__ import annotations

from typing import Any, Dict

import pytest
import torch
from transformers import BertConfig, BertForSequenceClassification, LlamaConfig, LlamaForCausalLM

from helpers import profiled_run_peak, requires_transformers, tiny_llama_config
from trainer_memcb.plan.answers.eval_memory import EvalSettings, containers_figures, plan_eval_memory

BATCH, SEQ = 4, 16


def llama(attn: str) -> LlamaConfig:
    return tiny_llama_config(attn, use_cache=False)


def bert(attn: str) -> BertConfig:
    config = BertConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                        vocab_size=100, max_position_embeddings=64, num_labels=2)
    config._attn_implementation = attn
    return config


MODELS = {"llama": (llama, LlamaForCausalLM), "bert": (bert, BertForSequenceClassification)}


def eval_batch(kind: str) -> Dict[str, torch.Tensor]:
    ids = torch.randint(0, 100, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    if kind == "llama":
        # transformers 5's prediction_step passes the count of labelled tokens, as training does.
        return {"input_ids": ids, "labels": ids.clone(), "num_items_in_batch": torch.tensor(float(ids.numel()))}
    return {"input_ids": ids, "labels": torch.zeros(BATCH, dtype=torch.long)}


def profiled_forward_peak(model: torch.nn.Module, inputs: Dict[str, Any]) -> int:
    """The most bytes allocated at once during a real no-grad forward, above what existed before it,
    from the profiler's allocation records in time order (outputs alive at the end included)."""
    model.eval()
    with torch.no_grad():
        model(**inputs)  # lazy buffers made on a first call are not the batch's
        return profiled_run_peak(lambda: model(**inputs))  # freed at the end: after its peak


@requires_transformers("5.0", "the forward's differences were measured on transformers 5.24 (its attention-mask "
                       "path and prediction_step's loss arguments); not measured on 4.57")
@pytest.mark.parametrize("kind,attn", [("llama", "eager"), ("llama", "sdpa"), ("bert", "eager"), ("bert", "sdpa")])
def test_the_planned_forward_peak_against_the_profilers_live_bytes(kind: str, attn: str) -> None:
    make_config, cls = MODELS[kind]

    def build() -> torch.nn.Module:
        with torch.device("meta"):
            return cls(make_config(attn))

    plan = plan_eval_memory(build, EvalSettings(batch_size=BATCH, samples=BATCH, seq_len=SEQ))
    assert plan.problem is None
    torch.manual_seed(0)
    real = profiled_forward_peak(cls(make_config(attn)), eval_batch(kind))
    # Measured here: llama eager 186,496 and sdpa 166,016, bert eager 82,432 and sdpa 66,048, planned =
    # profiled. The batch is a collator's (an all-ones mask), and its mask reads are answered as a real
    # unpadded batch's (trainer_memcb.plan.model.value_reads), so SDPA builds no causal mask in either.
    assert plan.forward_peak_bytes == real, (plan.forward_peak_bytes, real)


def test_containers_arithmetic_without_a_model() -> None:
    settings = EvalSettings(batch_size=8, samples=1000, seq_len=512)
    logits = 512 * 32000 * 4
    figures = containers_figures(settings, {"preds": logits, "labels": 512 * 8}, 4)
    # 1,000 samples of 512 tokens over a 32,000-token vocabulary: 65.5 GB of fp32 logits.
    assert figures["containers_device_bytes"] == 1000 * (logits + 512 * 8 + 4) == 65_540_100_000
    # The last batch's logits concatenation holds the old (992 samples), the new (8) and the result
    # (1,000), beside the losses (done) and the labels (not yet): twice the logits.
    assert figures["concat_peak_bytes"] == 2000 * logits + 992 * 512 * 8 + 1000 * 4 == 131_076_067_232
    every = containers_figures(EvalSettings(batch_size=8, samples=1000, seq_len=512, accumulation_steps=1),
                               {"preds": logits, "labels": 512 * 8}, 4)
    assert every["containers_device_bytes"] == 8 * (logits + 512 * 8 + 4)
    assert every["containers_host_bytes"] == figures["containers_host_bytes"] == 65_540_100_000
    lists = containers_figures(EvalSettings(batch_size=8, samples=1000, seq_len=512, concat_batches=False),
                               {"preds": logits, "labels": 512 * 8}, 4)
    assert lists["concat_peak_bytes"] == lists["containers_device_bytes"] == 65_540_100_000


def test_bad_settings_are_value_errors_that_name_them() -> None:
    with pytest.raises(ValueError, match="batch_size=0"):
        EvalSettings(batch_size=0, samples=1, seq_len=1)
    with pytest.raises(ValueError, match="logits='top5' is not one of: full, argmax, none"):
        EvalSettings(batch_size=1, samples=1, seq_len=1, logits="top5")
    with pytest.raises(ValueError, match="accumulation_steps=0"):
        EvalSettings(batch_size=1, samples=1, seq_len=1, accumulation_steps=0)
    with pytest.raises(ValueError, match="autocast='bfloat16' is not one of: None, 'bf16', 'fp16'"):
        EvalSettings(batch_size=1, samples=1, seq_len=1, autocast="bfloat16")


@pytest.mark.skipif(tuple(int(part) for part in torch.__version__.split(".")[:2]) < (2, 12),
                    reason="CUDA autocast's lists were read from torch 2.13; this torch registers others "
                           "(tests/plan/test_cuda_autocast.py)")
def test_a_cuda_evaluation_casts_by_cuda_autocasts_lists() -> None:
    # No GPU here: the CPU plans under autocast are held to real runs (tests/cli/test_cli_eval.py);
    # a CUDA plan differs from them only by the op lists it casts by, which tests/plan/test_cuda_autocast.py
    # holds against torch's own AutocastCUDA kernels.
    def build() -> torch.nn.Module:
        with torch.device("meta"):
            return BertForSequenceClassification(bert("eager"))

    def peak(autocast: Any, cuda: bool) -> int:
        settings = EvalSettings(batch_size=BATCH, samples=BATCH, seq_len=SEQ, autocast=autocast)
        plan = plan_eval_memory(build, settings, cuda_context_bytes=0 if cuda else None)
        assert plan.problem is None
        return plan.forward_peak_bytes

    plain = peak(None, cuda=False)
    assert peak(None, cuda=True) == plain
    # CUDA's softmax policy (fp32_set_opt_dtype) keeps the attention probabilities, 4 x 4 heads x
    # 16 x 16, in float32 where CPU autocast leaves them in bf16: 2 bytes more each.
    cuda_bf16 = peak("bf16", cuda=True)
    assert cuda_bf16 == peak("bf16", cuda=False) + 4 * 4 * 16 * 16 * 2
    assert cuda_bf16 > plain  # the weights' bf16 copies, for one
    # fp16 autocasts on CUDA as bf16 does; accelerate runs no fp16 autocast on the CPU.
    assert peak("fp16", cuda=True) == cuda_bf16
    assert peak("fp16", cuda=False) == plain


@pytest.mark.parametrize("full_eval", ["bf16_full_eval", "fp16_full_eval"])
def test_a_full_16_bit_evaluation_outside_train_is_planned_on_the_cast_model(tmp_path: Any, full_eval: str) -> None:
    from transformers import Trainer, TrainingArguments

    from trainer_memcb import OptimizerMemoryCallback
    from trainer_memcb.plan.answers.eval_memory import eval_settings_from_args

    class Tokens(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 6

        def __getitem__(self, index: int) -> Dict[str, torch.Tensor]:
            ids = (torch.arange(SEQ) + index) % 100
            return {"input_ids": ids, "labels": ids.clone()}

    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, per_device_eval_batch_size=BATCH, report_to=[],
                             disable_tqdm=True, **{full_eval: True})

    def evaluated() -> Dict[str, Any]:
        torch.manual_seed(0)
        trainer = Trainer(model=LlamaForCausalLM(llama("sdpa")), args=args, eval_dataset=Tokens(),
                          compute_metrics=lambda p: {"seen": float(len(p.label_ids))},
                          callbacks=[OptimizerMemoryCallback(eval_keys="all", what_if=())])
        logged = trainer.evaluate()  # outside train(): evaluation_loop casts the model first
        assert next(trainer.model.parameters()).dtype == (torch.bfloat16 if full_eval == "bf16_full_eval"
                                                          else torch.float16)
        return logged

    def build() -> torch.nn.Module:
        with torch.device("meta"):
            return LlamaForCausalLM(llama("sdpa"))

    settings = eval_settings_from_args(args, samples=6, seq_len=SEQ)
    assert settings.model_dtype == full_eval[:4] and settings.autocast is None
    assert eval_settings_from_args(args, samples=6, seq_len=SEQ, in_train=True).model_dtype is None
    plan = plan_eval_memory(build, settings)
    keys = ("forward_peak_bytes", "containers_device_bytes", "containers_host_bytes", "concat_peak_bytes",
            "host_concat_peak_bytes")
    # Three runs: the cast frees the model's fp32 storages after the probe wrapped its forward, and
    # the forward's own storages could take their addresses again. The probe read the model's
    # storages at wrapping, and then logged 66,688 to 91,176 bytes from run to run (in about half of
    # 24 runs less than the plan); it reads them at the forward now.
    for _ in range(3):
        logged = evaluated()
        assert {key: getattr(plan, key) for key in keys} == {key: logged[f"eval_{key}"] for key in keys}
    assert plan.forward_peak_bytes == 91176
    # 16-bit logits on the device (6 x 16 x 128 x 2 bytes), float32 arrays on the host.
    assert plan.per_sample_bytes["preds"] == SEQ * 128 * 2


def test_the_probe_leaves_out_the_storages_the_model_has_at_its_forward(tmp_path: Any, monkeypatch: Any) -> None:
    # bf16_full_eval casts the model after the probe has wrapped its forward: what the forward must
    # not count is the cast model's storages (and the batch's), read when the forward runs.
    from transformers import Trainer, TrainingArguments

    from trainer_memcb import OptimizerMemoryCallback
    from trainer_memcb.state.saved_tensors import storages_of
    from trainer_memcb.training import evaluation_probe

    excluded = []
    original = evaluation_probe._ForwardStorages.__init__

    def recording(self: Any, exclude: Any = (), **kwargs: Any) -> None:
        excluded.append(set(exclude))
        original(self, exclude=exclude, **kwargs)

    monkeypatch.setattr(evaluation_probe._ForwardStorages, "__init__", recording)

    class Tokens(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return BATCH

        def __getitem__(self, index: int) -> Dict[str, torch.Tensor]:
            ids = (torch.arange(SEQ) + index) % 100
            return {"input_ids": ids, "labels": ids.clone()}

    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, per_device_eval_batch_size=BATCH, report_to=[],
                             disable_tqdm=True, bf16_full_eval=True)
    trainer = Trainer(model=LlamaForCausalLM(llama("sdpa")), args=args, eval_dataset=Tokens(),
                      callbacks=[OptimizerMemoryCallback(eval_keys="all", what_if=())])
    trainer.evaluate()
    [exclude] = excluded
    model = trainer.model
    assert next(model.parameters()).dtype == torch.bfloat16
    cast = {key for key, _, _ in storages_of(list(model.parameters()) + list(model.buffers()))}
    assert cast <= exclude


def _containers_batch_by_batch(settings: EvalSettings, per_sample: Dict[str, int], loss_bytes: int,
                               bf16: Any = ()) -> Dict[str, int]:
    """The containers' figures one batch at a time, as the evaluation loop takes them: the reference
    `containers_figures` must equal without a step per batch."""
    import math

    names = ("losses", "inputs", "preds", "labels")
    batches = math.ceil(settings.samples / settings.batch_size)
    last = settings.samples - (batches - 1) * settings.batch_size
    device, values, host = ({name: 0 for name in names} for _ in range(3))
    peaks = dict(containers_device_bytes=0, containers_host_bytes=0, concat_peak_bytes=0, host_concat_peak_bytes=0)

    def flush() -> None:
        for name in names:
            if device[name]:
                new = values[name] * (2 if name in bf16 else 1)
                moment = sum(host.values()) + new + (host[name] + new if settings.concat_batches and host[name] else 0)
                host[name] += new
                device[name] = values[name] = 0
                peaks["host_concat_peak_bytes"] = max(peaks["host_concat_peak_bytes"], moment)
                peaks["containers_host_bytes"] = max(peaks["containers_host_bytes"], sum(host.values()))

    for step in range(batches):
        rows = last if step == batches - 1 else settings.batch_size
        for name in names:
            if name == "losses":
                if not loss_bytes:
                    continue
                stored, new = loss_bytes * settings.batch_size, loss_bytes * rows
            elif name in per_sample:
                stored = new = per_sample[name] * rows
            else:
                continue
            if settings.concat_batches and device[name] > 0:
                moment = sum(device.values()) + stored + values[name] + new
                device[name] = values[name] = values[name] + new
            else:
                moment = sum(device.values()) + stored
                device[name] += stored
                values[name] += new
            peaks["concat_peak_bytes"] = max(peaks["concat_peak_bytes"], moment)
            peaks["containers_device_bytes"] = max(peaks["containers_device_bytes"], sum(device.values()))
        if settings.accumulation_steps is not None and (step + 1) % settings.accumulation_steps == 0:
            flush()
    flush()
    return peaks


def test_the_containers_without_a_step_per_batch_equal_them_batch_by_batch() -> None:
    import random

    chooser = random.Random(0)
    for _ in range(3000):
        settings = EvalSettings(batch_size=chooser.randint(1, 9), samples=chooser.randint(1, 120), seq_len=4,
                                accumulation_steps=chooser.choice([None, None, 1, 2, 3, 5, 7, 20]),
                                concat_batches=chooser.random() < 0.6)
        per_sample = {name: chooser.choice([3, 16, 40]) for name in ("inputs", "preds", "labels")
                      if chooser.random() < 0.7}
        loss = chooser.choice([0, 4])
        bf16 = tuple(name for name in per_sample if chooser.random() < 0.3)
        assert containers_figures(settings, per_sample, loss, bf16) == \
            _containers_batch_by_batch(settings, per_sample, loss, bf16), (settings, per_sample, loss, bf16)
