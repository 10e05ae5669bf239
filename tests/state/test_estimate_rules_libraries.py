"""The rules for GaLore, APOLLO, LOMO/AdaLomo, GrokAdamW, schedule-free, torch-optimi and
bitsandbytes' AdEMAMix, against the state the real optimizers make, to the byte, over the variants
their state depends on (rank, projection type, the parameter's dtype, 8-bit or not, Kahan
summation, ...).

Each case estimates before the first step, trains two steps on the CPU, and checks: the estimate
equals `measure_optimizer_state` (total and per state key, same as before the first step), and the
measured bytes equal an independent count of every storage the optimizer holds
(`reference_walker`). The model (`TinyModel`) has a tied weight, a frozen layer, a bf16 layer and
sizes on both sides of the 8-bit thresholds.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from helpers import optimi_picks_triton
from reference_walker import held_bytes
from test_estimate_rules import EMBED_ROWS, SEQUENCE, TRAINABLE, TinyModel, assert_estimate_matches, train
from trainer_memcb import estimate_optimizer_state, measure_optimizer_state


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def check(model: nn.Module, optimizer: Any, step: Callable[[], None]) -> None:
    before = estimate_optimizer_state(optimizer)
    step()
    assert_estimate_matches(optimizer, before, TRAINABLE)
    assert measure_optimizer_state(optimizer).num_bytes == held_bytes(optimizer, model)


def low_rank_groups(model: TinyModel, **options: Any) -> List[Dict[str, Any]]:
    """The Trainer's layout (`_setup_low_rank_optimizer`): the target matrices (here `up`, the bf16
    `down` and `odd`) in a group with the low-rank options, everything else in another."""
    targets = [model.up.weight, model.down.weight, model.odd.weight]
    others = [p for p in model.parameters() if all(p is not t for t in targets)]
    return [{"params": others}, {"params": targets, **options}]


# -- bitsandbytes AdEMAMix -------------------------------------------------------------------------

ADEMAMIX = {
    "AdEMAMix": {},
    "AdEMAMix-optim_bits8": {"optim_bits": 8},
    "AdEMAMix-optim_bits8-min_8bit_size1": {"optim_bits": 8, "min_8bit_size": 1},
    "AdEMAMix8bit": {},
    "PagedAdEMAMix": {},
    "PagedAdEMAMix8bit": {},
}


@pytest.mark.filterwarnings("ignore:Paged optimizers are not supported on CPU")
@pytest.mark.parametrize("case", ADEMAMIX)
def test_bitsandbytes_ademamix(case: str) -> None:
    bnb = pytest.importorskip("bitsandbytes")
    model = TinyModel()
    optimizer = getattr(bnb.optim, case.split("-")[0])(model.parameters(), **ADEMAMIX[case])
    check(model, optimizer, lambda: train(model, optimizer))


# -- GaLore -----------------------------------------------------------------------------------------

GALORE_OPTIONS = {"update_proj_gap": 200, "scale": 0.25}


# Ranks below every matrix's size, and above it. reverse_std at a rank above the size fails in
# galore_torch's own project_back (it picks the side by the low-rank shape), so it is left out.
GALORE_ADAMW = [(proj_type, rank) for proj_type in ("std", "reverse_std", "right", "left", "full") for rank in (4, 200)
                if (proj_type, rank) != ("reverse_std", 200)]


@pytest.mark.parametrize("proj_type, rank", GALORE_ADAMW)
def test_galore_adamw_variants(proj_type: str, rank: int) -> None:
    galore = pytest.importorskip("galore_torch")
    model = TinyModel()
    optimizer = galore.GaLoreAdamW(low_rank_groups(model, rank=rank, proj_type=proj_type, **GALORE_OPTIONS), lr=1e-3)
    check(model, optimizer, lambda: train(model, optimizer))


@pytest.mark.parametrize("proj_type", ["std", "full"])
@pytest.mark.parametrize("beta1", [None, 0.9])
def test_galore_adafactor_variants(proj_type: str, beta1: Any) -> None:
    galore = pytest.importorskip("galore_torch")
    model = TinyModel()
    groups = low_rank_groups(model, rank=4, proj_type=proj_type, **GALORE_OPTIONS)
    # The Trainer's settings for galore_adafactor.
    optimizer = galore.GaLoreAdafactor(groups, lr=1e-3, relative_step=False, scale_parameter=False, beta1=beta1)
    check(model, optimizer, lambda: train(model, optimizer))


@pytest.mark.parametrize("rank", [4, 64])  # a low-rank state below 4096 values (32-bit), and at 8192 (8-bit)
def test_galore_adamw8bit_on_a_cpu_stand_in(rank: int, monkeypatch) -> None:
    # GaLore's AdamW8bit.step calls torch.cuda.synchronize() after every parameter, so it only runs
    # on CUDA; bitsandbytes' 8-bit kernels themselves run on the CPU. Stand-in: that one call made a
    # no-op, the rest of the real step unchanged.
    galore = pytest.importorskip("galore_torch")
    pytest.importorskip("bitsandbytes")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args, **kwargs: None)
    model = TinyModel()
    optimizer = galore.GaLoreAdamW8bit(low_rank_groups(model, rank=rank, proj_type="std", **GALORE_OPTIONS), lr=1e-3)
    check(model, optimizer, lambda: train(model, optimizer))
    assert "state1" in optimizer.state[model.up.weight]
    quantized = optimizer.state[model.up.weight]["state1"].dtype == torch.uint8
    assert quantized == (rank == 64)


# -- APOLLO -----------------------------------------------------------------------------------------

# apollo.py's step only works with proj_type="std" (its channel norm assumes std's layout, and
# the svd projector's "full" gives a list it cannot move), so the cases vary proj, rank, scale_type.
APOLLO = {
    "random-channel": {"proj": "random", "scale_type": "channel", "proj_type": "std"},
    "random-tensor": {"proj": "random", "scale_type": "tensor", "proj_type": "std"},
    "svd-channel": {"proj": "svd", "scale_type": "channel", "proj_type": "std"},
    "svd-tensor": {"proj": "svd", "scale_type": "tensor", "proj_type": "std"},
}


@pytest.mark.parametrize("rank", [4, 16])
@pytest.mark.parametrize("case", APOLLO)
def test_apollo_variants(case: str, rank: int) -> None:
    apollo = pytest.importorskip("apollo_torch")
    model = TinyModel()
    groups = low_rank_groups(model, rank=rank, update_proj_gap=200, scale=1.0, **APOLLO[case])
    optimizer = apollo.APOLLOAdamW(groups, lr=1e-3)
    check(model, optimizer, lambda: train(model, optimizer))


def test_apollo_without_its_norm_limiter_keeps_no_scaled_grad() -> None:
    apollo = pytest.importorskip("apollo_torch")
    model = TinyModel()
    groups = low_rank_groups(model, rank=4, proj="random", scale_type="channel", proj_type="std",
                             update_proj_gap=200, scale=1.0)
    optimizer = apollo.APOLLOAdamW(groups, lr=1e-3, disable_nl=True)
    check(model, optimizer, lambda: train(model, optimizer))
    assert "scaled_grad" not in measure_optimizer_state(optimizer).bytes_by_key


# -- LOMO and AdaLomo: the update runs inside backward ---------------------------------------------


def fused_train(model: nn.Module, optimizer: Any, steps: int = 2) -> None:
    generator = torch.Generator().manual_seed(0)
    for _ in range(steps):
        ids = torch.randint(0, EMBED_ROWS, (2, SEQUENCE), generator=generator)
        logits, aux = model(ids)
        loss = F.cross_entropy(logits.flatten(0, 1), ids.flatten()) + aux.pow(2).mean()
        optimizer.fused_backward(loss, 1e-3)


def test_lomo_holds_nothing() -> None:
    lomo = pytest.importorskip("lomo_optim")
    model = TinyModel(bf16=False)
    optimizer = lomo.Lomo(model)
    check(model, optimizer, lambda: fused_train(model, optimizer))
    assert measure_optimizer_state(optimizer).num_bytes == 0


def test_adalomo_on_a_cpu_stand_in(monkeypatch) -> None:
    # AdaLomo.__init__ makes its state with `.cuda()`, so it only runs on CUDA. Stand-in: `.cuda()`
    # returns the CPU tensor itself; the rest of the real optimizer (its state in attributes, for
    # every parameter of the model, frozen ones too) is unchanged.
    lomo = pytest.importorskip("lomo_optim")
    monkeypatch.setattr(torch.Tensor, "cuda", lambda self, *args, **kwargs: self)
    model = TinyModel(bf16=False)
    optimizer = lomo.AdaLomo(model, lr=1e-3)
    check(model, optimizer, lambda: fused_train(model, optimizer))
    measured = measure_optimizer_state(optimizer)
    # embed (= head) 70 x 64, frozen 64 x 64 + 64, up 128 x 64 + 128, down 64 x 128 + 64, odd 65 x 64 + 65:
    # rows + columns for a matrix, its length for a vector, fp32.
    assert measured.num_bytes == 4 * ((70 + 64) + (64 + 64) + 64 + (128 + 64) + 128 + (64 + 128) + 64 + (65 + 64) + 65)
    assert estimate_optimizer_state(optimizer).num_params == TRAINABLE


# -- GrokAdamW, schedule-free -----------------------------------------------------------------------


def test_grokadamw_state_in_its_param_groups() -> None:
    grokadamw = pytest.importorskip("grokadamw")
    model = TinyModel()
    optimizer = grokadamw.GrokAdamW(model.parameters(), lr=1e-3)
    with pytest.warns(FutureWarning):  # torch.cuda.amp.autocast() in its step
        check(model, optimizer, lambda: train(model, optimizer))
    assert optimizer.state == {}  # all of it in param_groups[0]["state"]
    assert measure_optimizer_state(optimizer).num_bytes > 0


SCHEDULE_FREE = [
    "AdamWScheduleFree", "RAdamScheduleFree", "SGDScheduleFree", "AdamWScheduleFreeReference",
    "AdamWScheduleFreePaper", "SGDScheduleFreeReference",
]


@pytest.mark.parametrize("name", SCHEDULE_FREE)
def test_schedule_free(name: str) -> None:
    schedulefree = pytest.importorskip("schedulefree")
    model = TinyModel()
    optimizer = getattr(schedulefree, name)(model.parameters(), lr=1e-3)
    optimizer.train()  # schedule-free optimizers step in train mode only
    check(model, optimizer, lambda: train(model, optimizer))


# -- torch-optimi -----------------------------------------------------------------------------------

OPTIMI = {
    "Adam": {}, "AdamW": {}, "Adan": {}, "Adan-kahan": {"kahan_sum": True}, "Lion": {}, "RAdam": {}, "Ranger": {},
    "StableAdamW": {},
    "StableAdamW-no_kahan": {"kahan_sum": False},
    "SGD": {}, "SGD-momentum": {"momentum": 0.9}, "SGD-torch_init": {"momentum": 0.9, "dampening": True, "torch_init": True},
    "Lion-no_kahan": {"kahan_sum": False},
}


@pytest.mark.parametrize("case", OPTIMI)
def test_torch_optimi(case: str) -> None:
    # TinyModel's `down` layer is bf16: a Kahan-summation buffer for it unless kahan_sum=False
    # (Adan's default).
    optimi = pytest.importorskip("optimi")
    model = TinyModel()
    name = case.split("-")[0]
    optimizer = getattr(optimi, name)(model.parameters(), lr=1e-3, **OPTIMI[case])
    if name == "StableAdamW" and optimi_picks_triton():
        # Triton importable (a CUDA build of torch): StableAdamW takes its Triton kernels, with a
        # one-value `mean_square` (fp32) and `kahan_comp` stand-in (uint8) per parameter. They
        # cannot launch on CPU tensors; the step makes all the state first, which is checked.
        before = estimate_optimizer_state(optimizer)
        with pytest.raises((RuntimeError, ValueError)):
            train(model, optimizer, steps=1)
        assert_estimate_matches(optimizer, before, TRAINABLE)
        assert measure_optimizer_state(optimizer).num_bytes == held_bytes(optimizer, model)
        tensors = sum(1 for p in model.parameters() if p.requires_grad)
        assert measure_optimizer_state(optimizer).bytes_by_key["mean_square"] == 4 * tensors
        return
    check(model, optimizer, lambda: train(model, optimizer))
    kahan_sum = OPTIMI[case].get("kahan_sum", False if name == "Adan" else None)
    has_kahan = "kahan_comp" in measure_optimizer_state(optimizer).bytes_by_key
    assert has_kahan == (kahan_sum is not False)


def test_torch_optimi_gradient_release() -> None:
    # Gradient release steps each parameter in its gradient hook and puts its param group (which
    # holds the parameters themselves) into each parameter's state: not state, not counted.
    optimi = pytest.importorskip("optimi")
    model = TinyModel()
    optimizer = optimi.StableAdamW(model.parameters(), lr=1e-3, gradient_release=True)
    optimi.prepare_for_gradient_release(model, optimizer)

    def released_train(steps: int = 2) -> None:  # the gradients are gone after their hook
        generator = torch.Generator().manual_seed(0)
        for _ in range(steps):
            ids = torch.randint(0, EMBED_ROWS, (2, SEQUENCE), generator=generator)
            logits, aux = model(ids)
            (F.cross_entropy(logits.flatten(0, 1), ids.flatten()) + aux.pow(2).mean()).backward()
            optimizer.step()
            optimizer.zero_grad()

    check(model, optimizer, released_train)
    assert all("group" in optimizer.state[p] for p in model.parameters() if p.requires_grad)


# -- transformers Adafactor with a first moment, as the Trainer builds it ---------------------------


def test_the_trainer_passes_no_optim_args_to_adafactor(tmp_path) -> None:
    # transformers 5.24 trainer_optimizer.py `_get_adafactor` passes only lr, scale_parameter=False
    # and relative_step=False: `optim_args="beta1=0.9"` does not reach it, so Adafactor through the
    # Trainer has no first moment. (Adafactor(beta1=...) built by hand is covered in
    # test_estimate_rules.py.)
    from transformers import Trainer

    from helpers import TinyDataset, tiny_classifier, training_args

    trainer = Trainer(model=tiny_classifier(), args=training_args(str(tmp_path), optim="adafactor", optim_args="beta1=0.9"),
                      train_dataset=TinyDataset())
    trainer.create_optimizer()
    assert {group["beta1"] for group in trainer.optimizer.param_groups} == {None}
