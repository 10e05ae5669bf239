"""Every built-in estimate rule against the state real optimizers make, to the byte.

Each case builds a small model, estimates before the first step, trains two steps on the CPU, and
checks the estimate against `measure_optimizer_state`: same total, same bytes per state key, same
trainable parameter count, and the same figure as before the first step.
"""

from __future__ import annotations

import sys
from typing import Any, Callable

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from trainer_memcb import estimate_optimizer_state, measure_optimizer_state, register_estimate_rule

EMBED_ROWS, WIDTH, HIDDEN, ODD = 70, 64, 128, 65
SEQUENCE = 6


class TinyModel(nn.Module):
    """Every case the rules branch on, by parameter (values; block sizes are 128 and 256):

    - `embed.weight` (70, 64) = 4480, tied to `head.weight`: >= 4096, a multiple of 128, not 256.
    - `up.weight` (128, 64) = 8192: >= 4096, a multiple of 256. `up.bias` 128: 1-D, < 4096.
    - `down.weight` (64, 128) = 8192 and `down.bias` 64 in bf16 (fp32 when `bf16=False`).
    - `odd.weight` (65, 64) = 4160: >= 4096, not a multiple of 128. `odd.bias` 65: not of 256.
    - `frozen` (64, 64) + 64: requires_grad=False, used in the forward pass.
    """

    def __init__(self, bf16: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(EMBED_ROWS, WIDTH)
        self.frozen = nn.Linear(WIDTH, WIDTH).requires_grad_(False)
        self.up = nn.Linear(WIDTH, HIDDEN)
        self.down = nn.Linear(HIDDEN, WIDTH).to(torch.bfloat16 if bf16 else torch.float32)
        self.odd = nn.Linear(WIDTH, ODD)
        self.head = nn.Linear(WIDTH, EMBED_ROWS, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor):
        hidden = self.embed(ids)
        hidden = hidden + self.frozen(hidden)
        hidden = torch.tanh(self.up(hidden))
        hidden = self.down(hidden.to(self.down.weight.dtype)).float()
        return self.head(hidden), self.odd(hidden)


# embed (= head), up, down, odd; the tied weight once, `frozen` not at all.
TRAINABLE = 4480 + (8192 + 128) + (8192 + 64) + (4160 + 65)


def train(model: nn.Module, optimizer: Any, steps: int = 2) -> None:
    """A loss every trainable parameter gets a gradient from."""
    generator = torch.Generator().manual_seed(0)
    for _ in range(steps):
        ids = torch.randint(0, EMBED_ROWS, (2, SEQUENCE), generator=generator)
        logits, aux = model(ids)
        loss = F.cross_entropy(logits.flatten(0, 1), ids.flatten()) + aux.pow(2).mean()
        loss.backward()
        assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
        optimizer.step()
        optimizer.zero_grad()


def assert_estimate_matches(optimizer: Any, estimate_before: Any, trainable: int) -> None:
    estimate = estimate_optimizer_state(optimizer)
    measured = measure_optimizer_state(optimizer)
    assert estimate is not None and estimate_before is not None
    assert estimate.to_dict() == estimate_before.to_dict()
    assert estimate.bytes_by_key == measured.bytes_by_key
    assert estimate.num_bytes == measured.num_bytes
    assert estimate.num_params == trainable


def _bnb():
    return pytest.importorskip("bitsandbytes")


def _torchao_optim():
    return pytest.importorskip("torchao.optim")


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _reset_bnb_overrides() -> None:
    bnb = sys.modules.get("bitsandbytes")
    if bnb is not None:
        bnb.optim.GlobalOptimManager.get_instance().initialize()


@pytest.fixture(autouse=True)
def fresh_bnb_overrides():
    """bitsandbytes' GlobalOptimManager is one per process: no override leaks between tests."""
    _reset_bnb_overrides()
    yield
    _reset_bnb_overrides()


def _bnb_args(**overrides: Any) -> Any:
    from bitsandbytes.optim.optimizer import MockArgs

    args = dict(optim_bits=8, min_8bit_size=4096, max_unorm=0.0, skip_zeros=False)
    args.update(overrides)
    return MockArgs(args)


def _bnb_embedding_override(model: nn.Module) -> Any:
    # What the Trainer does for optim="adamw_bnb_8bit": override after making the optimizer.
    bnb = _bnb()
    optimizer = bnb.optim.AdamW8bit(model.parameters())
    bnb.optim.GlobalOptimManager.get_instance().register_module_override(
        model.embed, "weight", {"optim_bits": 32}
    )
    return optimizer


def _bnb_param_override(model: nn.Module) -> Any:
    # An override before register_parameters lands in index2config; one after, in pid2config.
    bnb = _bnb()
    manager = bnb.optim.GlobalOptimManager.get_instance()
    manager.override_config(model.up.weight, "optim_bits", 32)
    manager.register_parameters(model.parameters())
    optimizer = bnb.optim.Adam(model.parameters(), optim_bits=8)
    manager.override_config(model.odd.bias, key_value_dict={"min_8bit_size": 1})
    return optimizer


def _hf_adafactor(**kwargs: Any) -> Callable[[Any], Any]:
    def make(params: Any) -> Any:
        from transformers.optimization import Adafactor

        return Adafactor(params, lr=1e-3, relative_step=False, scale_parameter=False, **kwargs)

    return make


def _bnb_class(name: str, **kwargs: Any) -> Callable[[Any], Any]:
    return lambda params: getattr(_bnb().optim, name)(params, **kwargs)


# id -> (optimizer factory, taking the model's parameters or, with `takes_model`, the model).
PARAM_CASES = {
    "torch-AdamW": lambda p: torch.optim.AdamW(p),
    "torch-AdamW-fused": lambda p: torch.optim.AdamW(p, fused=True),
    "torch-AdamW-foreach": lambda p: torch.optim.AdamW(p, foreach=True),
    "torch-Adam-amsgrad": lambda p: torch.optim.Adam(p, amsgrad=True),
    "torch-SGD": lambda p: torch.optim.SGD(p, lr=0.1),
    "torch-SGD-momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True),
    "torch-Adagrad": lambda p: torch.optim.Adagrad(p),
    "torch-RMSprop": lambda p: torch.optim.RMSprop(p),
    "torch-RMSprop-centered-momentum": lambda p: torch.optim.RMSprop(
        p, centered=True, momentum=0.9
    ),
    "torch-Adafactor": lambda p: torch.optim.Adafactor(p),
    "torch-NAdam": lambda p: torch.optim.NAdam(p),
    "torch-RAdam": lambda p: torch.optim.RAdam(p),
    "torch-Adamax": lambda p: torch.optim.Adamax(p),
    "torch-Adadelta": lambda p: torch.optim.Adadelta(p),
    "torch-Rprop": lambda p: torch.optim.Rprop(p),
    "torch-ASGD": lambda p: torch.optim.ASGD(p),
    "transformers-Adafactor": _hf_adafactor(),
    "transformers-Adafactor-beta1": _hf_adafactor(beta1=0.9),
    "bnb-Adam8bit": _bnb_class("Adam8bit"),
    "bnb-AdamW8bit": _bnb_class("AdamW8bit"),
    "bnb-PagedAdamW8bit": _bnb_class("PagedAdamW8bit"),
    "bnb-Lion8bit": _bnb_class("Lion8bit"),
    "bnb-Adam32bit": _bnb_class("Adam32bit"),
    "bnb-AdamW32bit": _bnb_class("AdamW32bit"),
    "bnb-PagedAdamW32bit": _bnb_class("PagedAdamW32bit"),
    "bnb-Lion32bit": _bnb_class("Lion32bit"),
    "bnb-Adam-optim_bits32": _bnb_class("Adam", optim_bits=32),
    "bnb-AdamW-optim_bits32": _bnb_class("AdamW", optim_bits=32),
    "bnb-AdamW-optim_bits8": _bnb_class("AdamW", optim_bits=8),
    # min_8bit_size: every tensor 8-bit (partial last blocks) / only the 8192s / none (the qmaps
    # are still held: an 8-bit optimizer makes them at construction).
    "bnb-AdamW8bit-min_8bit_size1": _bnb_class("AdamW8bit", min_8bit_size=1),
    "bnb-AdamW8bit-min_8bit_size5000": _bnb_class("AdamW8bit", min_8bit_size=5000),
    "bnb-AdamW8bit-min_8bit_size1e6": _bnb_class("AdamW8bit", min_8bit_size=10**6),
    "bnb-AdamW8bit-max_unorm": lambda p: _bnb().optim.AdamW8bit(p, args=_bnb_args(max_unorm=1.0)),
    "bnb-AdamW32bit-max_unorm": lambda p: _bnb().optim.AdamW32bit(
        p, args=_bnb_args(optim_bits=32, max_unorm=1.0)
    ),
    "bnb-LAMB8bit": _bnb_class("LAMB8bit"),
    "bnb-LARS8bit": _bnb_class("LARS8bit", lr=0.01, momentum=0.9),
    "bnb-RMSprop8bit": _bnb_class("RMSprop8bit"),
    "bnb-SGD8bit": _bnb_class("SGD8bit", lr=0.01, momentum=0.9),
    "bnb-Adagrad8bit": _bnb_class("Adagrad8bit"),
    "torchao-AdamW8bit": lambda p: _torchao_optim().AdamW8bit(p),
    "torchao-AdamW4bit": lambda p: _torchao_optim().AdamW4bit(p),
    "torchao-AdamWFp8": lambda p: _torchao_optim().AdamWFp8(p),
}
MODEL_CASES = {
    "bnb-AdamW8bit-embedding-override": _bnb_embedding_override,
    "bnb-Adam-override_config": _bnb_param_override,
}
def _make(case: str, model: nn.Module) -> Any:
    if case in MODEL_CASES:
        return MODEL_CASES[case](model)
    return PARAM_CASES[case](model.parameters())


@pytest.mark.filterwarnings("ignore:Paged optimizers are not supported on CPU")
@pytest.mark.parametrize("case", [*PARAM_CASES, *MODEL_CASES])
def test_estimate_equals_measured_state(case: str) -> None:
    # Every optimizer here accepts the bf16 parameters on the CPU, fused AdamW included.
    model = TinyModel()
    optimizer = _make(case, model)
    before = estimate_optimizer_state(optimizer)
    if case.startswith("torchao-"):
        # torchao steps through torch.compile, minutes of C++ compiling on the CPU; eager runs the
        # same step. The state is made before the compiled call either way.
        with torch.compiler.set_stance("force_eager"):
            train(model, optimizer)
    else:
        train(model, optimizer)
    assert_estimate_matches(optimizer, before, TRAINABLE)


def test_bnb_embedding_override_is_read_before_the_first_step() -> None:
    bnb = _bnb()
    with_override = estimate_optimizer_state(_bnb_embedding_override(TinyModel()))
    plain = estimate_optimizer_state(bnb.optim.AdamW8bit(TinyModel().parameters()))
    # The tied embedding (4480 values) goes from 2 x (N + 4 x 18 blocks) to 2 x 4N bytes.
    assert with_override.num_bytes - plain.num_bytes == 2 * (4 * 4480 - 4480 - 4 * 18)


def test_adagrad_state_exists_at_construction_frozen_params_included() -> None:
    model = TinyModel()
    optimizer = torch.optim.Adagrad(model.parameters())
    estimate = estimate_optimizer_state(optimizer)
    measured = measure_optimizer_state(optimizer)
    assert estimate.num_bytes == measured.num_bytes
    assert estimate.bytes_by_key == measured.bytes_by_key
    assert estimate.num_params == TRAINABLE


def test_a_tied_weight_listed_twice_in_a_group_counts_once() -> None:
    # Parameters gathered module by module meet the tied weight twice (under `embed` and `head`);
    # torch keeps both entries in the group (it warns), and the state has one entry for it.
    model = TinyModel()
    per_module = [param for module in model.modules() for param in module.parameters(recurse=False)]
    assert sum(param is model.embed.weight for param in per_module) == 2
    with pytest.warns(UserWarning, match="duplicate parameters"):
        optimizer = torch.optim.AdamW(per_module)
    estimate = estimate_optimizer_state(optimizer)
    assert (estimate.num_params, estimate.num_param_tensors) == (TRAINABLE, 7)
    assert estimate.to_dict() == estimate_optimizer_state(torch.optim.AdamW(TinyModel().parameters())).to_dict()
    train(model, optimizer)
    assert_estimate_matches(optimizer, estimate, TRAINABLE)


@pytest.mark.parametrize("fused", [False, True])
def test_step_is_8_bytes_when_the_default_dtype_is_float64(fused: bool) -> None:
    # torch/optim/optimizer.py _get_scalar_dtype: float64 scalars unless fused. The estimate reads
    # the default dtype when it runs, so everything is checked while it is float64.
    model = TinyModel(bf16=False)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        optimizer = torch.optim.Adam(model.parameters(), fused=fused)
        before = estimate_optimizer_state(optimizer)
        train(model, optimizer, steps=1)
        assert before.bytes_by_key["step"] == (4 if fused else 8) * 7
        assert_estimate_matches(optimizer, before, TRAINABLE)
    finally:
        torch.set_default_dtype(previous)


def test_sparse_adam() -> None:
    embedding = nn.Embedding(100, 8, sparse=True)
    optimizer = torch.optim.SparseAdam(embedding.parameters())
    before = estimate_optimizer_state(optimizer)
    embedding(torch.tensor([1, 2, 3])).sum().backward()
    optimizer.step()
    assert_estimate_matches(optimizer, before, 800)


@pytest.mark.parametrize("name", ["AdamW8bit", "AdamW4bit", "AdamWFp8"])
def test_torchao_amsgrad(name: str) -> None:
    optim = _torchao_optim()
    # Unquantized buffers (every tensor < 4096 values, or not a whole number of blocks).
    model = nn.Sequential(nn.Linear(32, 48), nn.Linear(48, 90))
    optimizer = getattr(optim, name)(model.parameters(), amsgrad=True)
    before = estimate_optimizer_state(optimizer)
    with torch.compiler.set_stance("force_eager"):
        model(torch.ones(2, 32)).sum().backward()
        optimizer.step()
    assert_estimate_matches(optimizer, before, 32 * 48 + 48 + 48 * 90 + 90)

    # Quantized max_exp_avg_sq: torchao 0.18's single_param_adam has no aten.maximum for its
    # quantized states, compiled or not, so the step fails; `_AdamBase.step` has made the
    # parameter's whole state by then.
    layer = nn.Linear(64, 64, bias=False)
    optimizer = getattr(optim, name)(layer.parameters(), amsgrad=True)
    before = estimate_optimizer_state(optimizer)
    assert before.bytes_by_key["max_exp_avg_sq"] == before.bytes_by_key["exp_avg_sq"] < 4 * 4096
    layer(torch.ones(2, 64)).sum().backward()
    try:
        with torch.compiler.set_stance("force_eager"):
            optimizer.step()
    except NotImplementedError:
        pass
    assert_estimate_matches(optimizer, before, 4096)


def test_trainer_adamw_bnb_8bit(tmp_path: Any) -> None:
    _bnb()
    from helpers import TinyDataset, training_args
    from transformers import DistilBertConfig, DistilBertForSequenceClassification, Trainer

    torch.manual_seed(0)
    # dim 64: the word embeddings (64 x 64) and most linear weights reach min_8bit_size = 4096.
    model = DistilBertForSequenceClassification(
        DistilBertConfig(
            vocab_size=64, dim=64, n_layers=1, n_heads=2, hidden_dim=128,
            max_position_embeddings=8, num_labels=2,
        )
    )
    args = training_args(str(tmp_path), optim="adamw_bnb_8bit", max_steps=2)
    trainer = Trainer(model=model, args=args, train_dataset=TinyDataset())
    # Made as train() would make it; the Trainer registers nn.Embedding weights for 32-bit state.
    before = estimate_optimizer_state(trainer.create_optimizer())
    trainer.train()
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert_estimate_matches(trainer.optimizer, before, trainable)
    word_embeddings = model.distilbert.embeddings.word_embeddings.weight
    assert word_embeddings.numel() >= 4096
    assert trainer.optimizer.optimizer.state[word_embeddings]["state1"].dtype == torch.float32


def test_user_rule_is_found_for_a_subclass() -> None:
    class MyOptimizer(torch.optim.Optimizer):
        def __init__(self, params: Any) -> None:
            super().__init__(params, {})

    class MySubclass(MyOptimizer):
        pass

    register_estimate_rule(
        MyOptimizer, lambda p, group, opt: {"buffer": 2 * p.num_bytes}, source="mine"
    )
    estimate = estimate_optimizer_state(MySubclass(nn.Linear(4, 2).parameters()))
    assert estimate.num_bytes == 2 * 4 * 10
    assert estimate.source == "mine"


def test_no_rule_gives_none() -> None:
    class Unknown(torch.optim.Optimizer):
        def __init__(self, params: Any) -> None:
            super().__init__(params, {})

    assert estimate_optimizer_state(Unknown(nn.Linear(4, 2).parameters())) is None
