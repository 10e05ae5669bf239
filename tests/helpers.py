"""Tiny real models and data for tests: built from configs, offline, a few steps on the CPU."""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import re
import weakref
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
import pytest
import torch
from transformers import DistilBertConfig, DistilBertForSequenceClassification, TrainingArguments

VOCAB_SIZE = 64
SEQUENCE_LENGTH = 8


def tiny_classifier(seed: int = 0) -> DistilBertForSequenceClassification:
    """A 2-label DistilBERT small enough to train in milliseconds."""
    torch.manual_seed(seed)
    config = DistilBertConfig(
        vocab_size=VOCAB_SIZE, dim=16, n_layers=1, n_heads=2, hidden_dim=32,
        max_position_embeddings=SEQUENCE_LENGTH, num_labels=2,
    )
    return DistilBertForSequenceClassification(config)


class TinyDataset(torch.utils.data.Dataset):
    """Label = whether token 1 appears in the first half: learnable, deterministic."""

    def __init__(self, size: int = 16, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.input_ids = torch.randint(2, VOCAB_SIZE, (size, SEQUENCE_LENGTH), generator=generator)
        self.labels = torch.randint(0, 2, (size,), generator=generator)
        self.input_ids[self.labels == 1, 0] = 1

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> Dict[str, torch.Tensor]:
        return {"input_ids": self.input_ids[index], "labels": self.labels[index]}


def accuracy_and_f1(eval_prediction: Any) -> Dict[str, float]:
    predictions = np.argmax(eval_prediction.predictions, axis=-1)
    labels = eval_prediction.label_ids
    true_positive = int(((predictions == 1) & (labels == 1)).sum())
    predicted = int((predictions == 1).sum())
    actual = int((labels == 1).sum())
    f1 = 2 * true_positive / (predicted + actual) if predicted + actual else 0.0
    return {"accuracy": float((predictions == labels).mean()), "f1": f1}


_SCRATCH: List[str] = []


def scratch_folder(name: str) -> str:
    """An output folder outside the repository, for a Trainer whose files no test reads (the
    Trainer makes its output folder): under one temporary folder of this process."""
    import tempfile

    if not _SCRATCH:
        _SCRATCH.append(tempfile.mkdtemp(prefix="trainer-memcb-tests-"))
    return os.path.join(_SCRATCH[0], name)


def training_args(output_dir: str, **overrides: Any) -> TrainingArguments:
    settings: Dict[str, Any] = dict(
        output_dir=output_dir, use_cpu=True, per_device_train_batch_size=4, per_device_eval_batch_size=8,
        max_steps=4, logging_steps=1, report_to=[], save_strategy="no", disable_tqdm=True,
        dataloader_num_workers=0, seed=0,
    )
    settings.update(overrides)
    return TrainingArguments(**settings)


# -- activations ------------------------------------------------------------------------------------


def independent_saved_bytes(model: torch.nn.Module, inputs: Dict[str, Any],
                            autocast: Optional[torch.dtype] = None, alive_at_end: bool = False) -> int:
    """Bytes of the distinct non-parameter storages that one forward of `model` on `inputs` saves
    for backward: a plain saved-tensors walk that keeps every saved tensor (so that no storage is
    freed and its address reused before the count is done).

    With `alive_at_end`, only the storages still saved when the forward returns: a saved tensor
    whose graph the forward itself dropped (an output it computed and did not return: a Llava's
    pooled vision output) is left out, as the step plan's figure leaves it out."""
    params = {(param.device, param.untyped_storage().data_ptr()) for param in model.parameters()}
    kept: List[torch.Tensor] = []
    sizes: Dict[Tuple[torch.device, int], int] = {}
    holders: List[Tuple[Tuple[torch.device, int], Any]] = []

    class Holder:
        def __init__(self, tensor: torch.Tensor) -> None:
            self.tensor = tensor

    def pack(tensor: torch.Tensor) -> Any:
        kept.append(tensor)
        key = (tensor.device, tensor.untyped_storage().data_ptr())
        if key not in params:
            sizes[key] = tensor.untyped_storage().nbytes()
        holder = Holder(tensor)
        holders.append((key, weakref.ref(holder)))
        return holder

    context: Any = torch.autocast("cpu", dtype=autocast) if autocast is not None else contextlib.nullcontext()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda holder: holder.tensor), context:
        output = model(**inputs)
    assert output.loss is not None and sizes  # a training forward, which saved something
    if alive_at_end:
        alive = {key for key, ref in holders if ref() is not None}
        return sum(nbytes for key, nbytes in sizes.items() if key in alive)
    return sum(sizes.values())



def entries_with(log_history: List[Dict[str, Any]], key: str) -> List[Dict[str, Any]]:
    return [entry for entry in log_history if key in entry]


# -- versions ---------------------------------------------------------------------------------------
# The suite runs on the newest releases and, in .ci/run's compatibility pass, on the oldest ones
# setup.cfg allows (.ci/oldest-constraints.txt). A test of something newer releases added says so
# with a marker below, which skips it with the reason on the older ones.


def installed_version(distribution: str) -> Optional[Tuple[int, ...]]:
    """The release numbers of an installed distribution, `(2, 6, 0)` for torch 2.6.0+cpu; None when
    it is not installed."""
    try:
        version = importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None
    return tuple(int(part) for part in re.findall(r"\d+", version.split("+")[0])[:3])


def _release(version: str) -> Tuple[int, ...]:
    return tuple(int(part) for part in version.split("."))


def requires_version(distribution: str, minimum: str, why: str) -> pytest.MarkDecorator:
    """Skip unless `distribution` is installed at `minimum` or newer; `why` says what that release
    added, and shows in the skip reason."""
    installed = installed_version(distribution)
    return pytest.mark.skipif(
        installed is None or installed < _release(minimum),
        reason=f"needs {distribution}>={minimum} ({why}); installed: "
               f"{'none' if installed is None else '.'.join(map(str, installed))}",
    )


def profiled_run_peak(run: Callable[[], Any]) -> int:
    """The most bytes the profiler records alive above what was alive before `run()`: its memory
    records replayed in time order (a CPU run's allocations and frees, each storage's whole size)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    return profiled_peak(prof)


def profiled_peak(prof: Any) -> int:
    """The most bytes a finished `torch.profiler.profile(profile_memory=True)` recorded alive above
    what was alive when it started (`profiled_run_peak`'s replay, for a profile started and stopped
    apart, in a Trainer's callbacks)."""
    records = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                     key=lambda e: e.start_ns())
    alive = peak = 0
    for record in records:
        alive += record.nbytes()
        peak = max(peak, alive)
    return peak


def storage_bytes(tensors: List[torch.Tensor]) -> int:
    """The bytes of the storages behind `tensors`, each storage once."""
    return sum({t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in tensors}.values())


def real_step_peak(model: torch.nn.Module, optimizer: Any, batches: List[Dict[str, Any]]) -> Tuple[int, int]:
    """A real optimizer step's memory after a first one (the optimizer state made, as in every later
    step): (the bytes alive before it, the most the profiler records above them in time order).

    The step is the Trainer's: each batch's forward and backward (the loss freed before the next),
    the gradients clipped to norm 1, the optimizer's step, the gradients set to None."""

    def step() -> None:
        for inputs in batches:
            loss = model(**inputs).loss
            loss.backward()
            del loss
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()
    tensors = list(model.parameters()) + list(model.buffers()) + [t for b in batches for t in b.values()]
    tensors += [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    return storage_bytes(tensors), profiled_run_peak(step)


def saved_dtypes_by_node(output: torch.Tensor, keep: Callable[[torch.Tensor], bool]) -> Dict[str, List[torch.dtype]]:
    """The dtypes of the tensors that each kind of autograd node behind `output` saved (its
    `_saved_*` attributes), of those `keep` accepts, by the node's class name; each node once."""
    found: Dict[str, List[torch.dtype]] = {}
    seen, todo = set(), [output.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        for attribute in dir(node):
            if attribute.startswith("_saved_"):
                value = getattr(node, attribute)
                for tensor in value if isinstance(value, (tuple, list)) else [value]:
                    if isinstance(tensor, torch.Tensor) and keep(tensor):
                        found.setdefault(type(node).__name__, []).append(tensor.dtype)
        todo.extend(next_node for next_node, _ in node.next_functions)
    return found


def tiny_bf16_llama(heads_k: int = 2, layers: int = 1) -> Any:
    """A Llama of `layers` layers (hidden 64, 4 heads, `heads_k` key/value heads, vocabulary 256) in
    bf16, seeded, without a KV cache: the flash-attention tests' model."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                         num_key_value_heads=heads_k, vocab_size=256)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.config.use_cache = False
    return model


def flash_forward_saved_bytes(attn: str, padding: int, stand_ins: Any) -> Tuple[int, Any]:
    """A real CPU forward of `tiny_bf16_llama()` (2 rows of 256 tokens, the last `padding` of each
    masked) through transformers' path for `attn` inside `stand_ins` (the flash kernels' CPU
    stand-ins, a context; the attention is set inside it, where a hub kernel is registered): the
    bytes autograd saves, parameters left out, and what the context gave (its run's record)."""
    model = tiny_bf16_llama()
    ids = torch.randint(0, 256, (2, 256), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 256, dtype=torch.long)
    if padding:
        mask[:, -padding:] = 0
    seen: Dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        seen[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with stand_ins as run, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.config._attn_implementation = attn
        model(input_ids=ids, attention_mask=mask, labels=ids)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    return sum(size for ptr, size in seen.items() if ptr not in params), run


TRANSFORMERS_4 = (installed_version("transformers") or (5,)) < (5,)


def rotary_buffers_beyond_transformers_5s(model: Any) -> int:
    """A plan's peak counts the model's buffers. transformers 5 keeps a rotary embedding's
    `original_inv_freq` as a buffer beside `inv_freq`; 4.x keeps it as a plain attribute. A figure
    counted on transformers 5 is this many bytes off on the installed release: 0, or minus the
    `inv_freq` bytes on 4.x."""
    if not TRANSFORMERS_4:
        return 0
    return -sum(buffer.numel() * buffer.element_size() for name, buffer in model.named_buffers()
                if name.endswith("inv_freq"))


def rotary_matmul_flops_of_transformers_4(batch_rows: int, seq_len: int, inv_freq_values: int) -> int:
    """transformers 4.x computes a rotary embedding's angles as a batched matmul,
    `inv_freq[None, :, None] @ position_ids[:, None, :]` (one row of positions per batch row it is
    given), which torch's FLOP counter counts; transformers 5 multiplies by broadcasting (no FLOPs).
    The FLOPs a figure counted on transformers 5 lacks on the installed release."""
    return 2 * batch_rows * inv_freq_values * seq_len if TRANSFORMERS_4 else 0


def requires_torch(minimum: str, why: str) -> pytest.MarkDecorator:
    """`@requires_torch("2.7", "what it added")`: skip on an older torch, saying why."""
    return requires_version("torch", minimum, why)


def requires_transformers(minimum: str, why: str) -> pytest.MarkDecorator:
    """`@requires_transformers("5.0", "what it added")`: skip on an older transformers, saying why."""
    return requires_version("transformers", minimum, why)


def requires_accelerate(minimum: str, why: str) -> pytest.MarkDecorator:
    """`@requires_accelerate("1.11", "what it added")`: skip on an older accelerate, saying why."""
    return requires_version("accelerate", minimum, why)


def drawn_on_a_terminal(draw: Callable[[Any], None]) -> str:
    """What `draw(stream)` writes to a real pseudo-terminal (where rich draws boxed tables)."""
    leader, follower = os.openpty()
    with os.fdopen(follower, "w", encoding="utf-8", closefd=True) as terminal:
        draw(terminal)
    return read_until_closed(leader).decode("utf-8")


def read_until_closed(leader: int) -> bytes:
    """Everything written to a pseudo-terminal whose follower side is (or will be) closed; closes
    `leader`."""
    chunks = []
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # the follower side is closed: everything has been read
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(leader)
    return b"".join(chunks)


def optimi_picks_triton() -> bool:
    """Whether torch-optimi's StableAdamW, given triton=None, takes its Triton kernels here: its
    `_init_group` (0.3.3) resolves triton from an empty parameter list, so whenever Triton imports
    (a CUDA build of torch brings it). Those kernels cannot step CPU tensors."""
    try:
        import optimi.utils
    except ImportError:
        return False
    return bool(optimi.utils.HAS_TRITON)


# The tests' tiny Llama: hidden 64, an MLP of 128, 2 layers of 4 heads (4 key and value heads).
TINY_LLAMA = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=4)


def tiny_llama_config(attn: str, **overrides: Any) -> Any:
    """The tiny Llama's config, a vocabulary of 128 and 64 positions unless `overrides` say
    otherwise, its attention implementation `attn` (set as `from_pretrained` sets it)."""
    from transformers import LlamaConfig

    config = LlamaConfig(**{**TINY_LLAMA, "vocab_size": 128, "max_position_embeddings": 64, **overrides})
    config._attn_implementation = attn
    return config


def trl_llama_config(**overrides: Any) -> Any:
    """The tiny Llama the TRL steps are planned and run with: hidden 32, 2 layers of 2 heads, an
    untied head, pad 0 and EOS 1 (TRL's collators and generation read them), no BOS; a vocabulary
    of 64 and 64 positions unless `overrides` say otherwise."""
    from transformers import LlamaConfig

    return LlamaConfig(**{**dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                                 tie_word_embeddings=False, pad_token_id=0, eos_token_id=1, bos_token_id=None),
                          **overrides})


def tiny_llama_folder(tmp_path_factory: Any, label: str, **overrides: Any) -> str:
    """A folder holding a tiny Llama's config.json, as `estimate` reads a model: hidden 64, 2 layers of
    4 heads, a vocabulary of 256 and 64 positions, unless `overrides` say otherwise."""
    from transformers import LlamaConfig

    values = dict(TINY_LLAMA, vocab_size=256, max_position_embeddings=64, architectures=["LlamaForCausalLM"])
    values.update(overrides)
    folder = tmp_path_factory.mktemp(label)
    LlamaConfig(**values).save_pretrained(folder)
    return str(folder)


# The smallest Llama of the command-line refusal tests: one layer of two heads.
SMALLEST_LLAMA = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=2, vocab_size=96)


def run_estimate(argv: List[str], capsys: Any) -> Tuple[int, str, str]:
    """`trainer-memcb estimate ARGV` in this process: its exit code, stdout and stderr."""
    from trainer_memcb.cli import main

    code = main(["estimate"] + list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def one_line(err: str) -> str:
    """The one line a refusal says (an assertion error where it says more or less)."""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


def smallest_llama(**overrides: Any) -> Any:
    """The `LlamaConfig` of `SMALLEST_LLAMA` (64 positions), with `overrides`."""
    from transformers import LlamaConfig

    values = dict(SMALLEST_LLAMA, max_position_embeddings=64, architectures=["LlamaForCausalLM"])
    values.update(overrides)
    return LlamaConfig(**values)


def made_step_plan(batch_size: int, peak_bytes: Optional[int], *, activations_peak_bytes: Optional[int] = None,
                   fits: Optional[bool] = None, problem: Optional[str] = None) -> Any:
    """A step plan made by hand, for the search and the tables over plans: its batch, its peak (None
    with a `problem`: a step that could not be traced) and, where given, its activations' peak and
    fits?; on the CPU, fp32 AdamW, one token per sample."""
    from trainer_memcb.plan.answers.step_plan import PlannedSettings, StepMemoryPlan, StepPeak, Verdict

    settings = PlannedSettings(model="m", batch_size=batch_size, seq_len=1, attn_implementation=None,
                               device_type="cpu", traced_on="cpu", gradient_checkpointing=False,
                               checkpointing_kwargs={}, precision="fp32", param_dtype="float32",
                               optimizer="adamw_torch")
    step = StepPeak(activations_bytes=activations_peak_bytes, activations_peak_bytes=activations_peak_bytes,
                    peak_bytes=peak_bytes, peak_phase=None if peak_bytes is None else "backward", problem=problem)
    return StepMemoryPlan(settings, step, verdict=Verdict(fits=fits))


def trl_step_peak(trainer: Any, batch: Dict[str, Any], **step_kwargs: Any) -> Tuple[int, int]:
    """A TRL trainer's real optimizer step on `batch` (one collated micro-batch), twice: the first
    makes the optimizer state, the second is profiled. Returns what was alive before the second
    (parameters, buffers, the batch's tensors, the optimizer state, a reference model's parameters)
    and the most the profiler records alive above it: `Trainer.training_step(model, batch,
    **step_kwargs)`, clipping at 1.0, the optimizer's step, zero_grad."""
    model = trainer.model
    model.train()
    trainer.create_optimizer()
    trainer.current_gradient_accumulation_steps = 1  # as train() sets it for each step
    optimizer = trainer.optimizer

    def step() -> None:
        trainer.training_step(model, batch, **step_kwargs)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()
    tensors = list(model.parameters()) + list(model.buffers())
    tensors += [value for value in list(batch.values()) + list(step_kwargs.values()) if isinstance(value, torch.Tensor)]
    tensors += [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    if getattr(trainer, "ref_model", None) is not None:
        tensors += list(trainer.ref_model.parameters()) + list(trainer.ref_model.buffers())
    return storage_bytes(tensors), profiled_run_peak(step)


def trl_config_files(tmp_path_factory: Any, label: str, config_cls: Any, batch: int, max_length: int,
                     configs: Dict[str, Dict[str, Any]], bad: Dict[str, Any]) -> Dict[str, str]:
    """A folder for a TRL trainer's command-line tests: the DPO step tests' tiny Llama ("model"),
    each of `configs` as `config_cls(...).to_json_string()` writes it (fp32, no checkpointing, AdamW,
    `batch` rows of `max_length`, the entry's fields over them), and each of `bad` as raw JSON; the
    paths by name."""
    import json

    from plan.test_dpo_step import _config

    folder = tmp_path_factory.mktemp(label)
    _config().save_pretrained(folder / "llama")
    paths = {"model": str(folder / "llama")}
    for name, extra in configs.items():
        config = config_cls(str(folder / "out"), use_cpu=True, report_to=[], per_device_train_batch_size=batch,
                            max_length=max_length, bf16=False, gradient_checkpointing=False, optim="adamw_torch",
                            **extra)
        (folder / f"{name}.json").write_text(config.to_json_string())
        paths[name] = str(folder / f"{name}.json")
    for name, values in bad.items():
        (folder / f"{name}.json").write_text(json.dumps(values))
        paths[name] = str(folder / f"{name}.json")
    return paths


def valid_estimate_document(document: Dict[str, Any]) -> Dict[str, Any]:
    """`document` (an `estimate --json` output), after checking it against the committed
    docs/estimate.schema.json (a `jsonschema.ValidationError` where it is not valid)."""
    import json

    import jsonschema

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "estimate.schema.json")
    with open(path, encoding="utf-8") as handle:
        jsonschema.Draft202012Validator(json.load(handle)).validate(document)
    return document


def loaded_trl_config(path: str, config_cls: Any, output_dir: str) -> Tuple[Dict[str, Any], Any]:
    """The JSON `--write-training-args` wrote to `path`, and TRL's own config class `config_cls`
    made from it (`output_dir` in place of the file's): what `XConfig(**json.load(f))` gives."""
    import json

    with open(path, encoding="utf-8") as handle:
        document = json.load(handle)
    return document, config_cls(**dict(document, output_dir=output_dir))
