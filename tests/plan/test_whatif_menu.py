"""The what-if over the Trainer's whole `optim` menu: every `OptimizerNames` value, built on the meta
device as `Trainer.create_optimizer` builds it on the real model, with the same estimate; exact
bytes for the names whose figures are written out here by hand; a row with the reason for every
name that cannot be built; `optim_args` and `optim_target_modules` checked and passed through."""

from __future__ import annotations

import importlib.util
import math
import sys

import pytest
import torch
from transformers import Trainer
from transformers.training_args import OptimizerNames

from helpers import requires_transformers, tiny_classifier, training_args
from trainer_memcb import estimate_optimizer_state
from trainer_memcb.cli import main
from trainer_memcb.plan.settings.optim_options import parse_optim_args, parse_optim_target_modules
from trainer_memcb.plan.model.stand_ins import meta_stand_in
from trainer_memcb.plan.optimizers.trainer_optimizers import OptimizerUnavailable, build_trainer_optimizer
from trainer_memcb.state.unwrap import inner_optimizers
from trainer_memcb.plan.optimizers.whatif import what_if

# GaLore and APOLLO need target modules; on the tiny DistilBERT these are its six attention and
# feed-forward nn.Linear layers (q_lin, k_lin, v_lin, out_lin, lin1, lin2).
TARGETS = ".*(attention|ffn).*"


def _shapes():
    return [tuple(param.shape) for param in tiny_classifier().parameters()]


def _adamw(shapes):
    # exp_avg and exp_avg_sq in fp32, a 4-byte step per tensor (torch; torchao below 4096 values
    # keeps plain fp32 buffers and a 0-dim fp32 step too).
    return sum(8 * math.prod(shape) + 4 for shape in shapes)


def _one_fp32_buffer_and_step(shapes):
    # Adagrad's sum, RMSprop's square_avg, plus a 4-byte step per tensor.
    return sum(4 * math.prod(shape) + 4 for shape in shapes)


def _adafactor(shapes):
    # transformers Adafactor as the Trainer builds it (no first moment): row and column factors
    # for matrices, a full second moment for vectors, and an fp32 RMS per tensor.
    return sum(4 * (shape[0] + shape[1]) + 4 if len(shape) == 2 else 4 * shape[0] + 4 for shape in shapes)


def _bnb(states, shapes):
    # bitsandbytes below min_8bit_size (4096 values: every tensor of the tiny model) keeps
    # `states` fp32 buffers, 8-bit names included; no step tensor.
    assert all(math.prod(shape) < 4096 for shape in shapes)
    return sum(4 * states * math.prod(shape) for shape in shapes)


# An 8-bit bitsandbytes optimizer fills its two 256-value fp32 quantization maps (name2qmap) at
# construction (Optimizer8bit.__init__ -> fill_qmap), even when no tensor reaches min_8bit_size.
QMAPS = 2 * 256 * 4
# Those maps are counted once the rule registry declares name2qmap as where bitsandbytes holds
# state (trainer_memcb.state.registry); before it, the estimate leaves them out.
MAPS_COUNTED = importlib.util.find_spec("trainer_memcb.state.registry") is not None

SHAPES = _shapes()
# The names whose rules exist today, with the bytes written out from the shapes.
EXACT = {
    "adamw_torch": _adamw(SHAPES),
    "adamw_torch_fused": _adamw(SHAPES),
    "adamw_torch_4bit": _adamw(SHAPES),
    "adamw_torch_8bit": _adamw(SHAPES),
    "adafactor": _adafactor(SHAPES),
    "sgd": 0,
    "adagrad": _one_fp32_buffer_and_step(SHAPES),
    "rmsprop": _one_fp32_buffer_and_step(SHAPES),
    "paged_adamw_32bit": _bnb(2, SHAPES),
    **{name: _bnb(1, SHAPES) for name in ("lion_32bit", "paged_lion_32bit", "rmsprop_bnb", "rmsprop_bnb_32bit")},
    **{name: _bnb(2, SHAPES) + QMAPS for name in ("adamw_bnb_8bit", "adamw_8bit", "paged_adamw_8bit")},
    **{name: _bnb(1, SHAPES) + QMAPS for name in ("lion_8bit", "paged_lion_8bit", "rmsprop_bnb_8bit")},
}
EIGHT_BIT = {name for name in EXACT if name.endswith("_8bit") and name != "adamw_torch_8bit"}
# Not installed here, and why the Trainer needs them.
MISSING = {"adamw_torch_xla": "torch_xla", "adamw_torch_npu_fused": "torch_npu", "adamw_anyprecision": "torchdistx"}
if "adamw_apex_fused" in {name.value for name in OptimizerNames}:  # transformers 4.x only
    MISSING["adamw_apex_fused"] = "apex"


def test_the_hand_written_figures_of_the_tiny_model():
    assert (sum(math.prod(shape) for shape in SHAPES), len(SHAPES)) == (3714, 24)
    assert (EXACT["adamw_torch"], EXACT["adafactor"], EXACT["adagrad"], EXACT["paged_adamw_32bit"],
            EXACT["lion_32bit"], EXACT["adamw_8bit"], EXACT["lion_8bit"]) == (
        29_808, 2_512, 14_952, 29_712, 14_856, 31_760, 16_904)


@pytest.mark.parametrize("name", [
    pytest.param(name, marks=pytest.mark.xfail(
        name in EIGHT_BIT and not MAPS_COUNTED, strict=True,
        reason="bitsandbytes' name2qmap maps are counted once the registry declares where they are held"))
    for name in EXACT])
def test_the_what_if_figure_is_exact_on_the_tiny_model(name):
    (entry,) = what_if(tiny_classifier(), [name]).optimizers
    assert (entry.estimate.num_bytes, entry.estimate.num_params, entry.estimate.num_param_tensors) == (
        EXACT[name], 3714, 24)


def _structure(optimizer):
    """What decides the state: per real optimizer, its class and per group the parameter shapes
    and trainability and the hyperparameters."""
    described = []
    for inner in inner_optimizers(optimizer):
        groups = []
        for group in inner.param_groups:
            settings = {key: repr(value) for key, value in group.items()
                        if key != "params" and not isinstance(value, torch.Tensor)}
            groups.append(([(tuple(p.shape), p.dtype, p.requires_grad) for p in group["params"]], settings))
        described.append((f"{type(inner).__module__}.{type(inner).__qualname__}", groups))
    return described


@pytest.mark.parametrize("name", [name.value for name in OptimizerNames])
def test_the_what_if_builds_each_name_as_the_trainer_does(name, tmp_path):
    args = training_args(str(tmp_path), optim=name, optim_target_modules=TARGETS)
    result = what_if(tiny_classifier(), [name], args=args)
    (entry,) = result.optimizers
    assert entry.name == name

    # The Trainer itself, on the real model.
    trainer = Trainer(model=tiny_classifier(), args=args)
    try:
        real = trainer.create_optimizer()
    except Exception as error:  # the Trainer cannot build it here either
        assert entry.estimate is None and entry.problem, (name, error)
        if name in MISSING:
            assert entry.missing_package == MISSING[name]
            assert entry.problem.startswith(f"needs the {MISSING[name]} package, not installed here (")
        return
    assert name not in MISSING
    built = build_trainer_optimizer(name, args, meta_stand_in(tiny_classifier()))
    assert _structure(built) == _structure(real)
    assert all(p.device.type == "meta" for inner in inner_optimizers(built)
               for group in inner.param_groups for p in group["params"]
               if type(inner).__name__ != "LayerWiseDummyOptimizer")

    expected = estimate_optimizer_state(real)
    if expected is None:  # no rule for this class yet: the row says so
        assert entry.estimate is None
        assert entry.problem == f"no estimate rule for {entry.optimizer_class}"
        assert name not in EXACT
        return
    assert entry.estimate.to_dict() == expected.to_dict()


def test_every_name_of_the_menu_gets_a_row_and_no_traceback():
    names = [name.value for name in OptimizerNames]
    result = what_if(tiny_classifier(), names, optim_target_modules=TARGETS)
    assert [entry.name for entry in result.optimizers] == names
    for entry in result.optimizers:
        assert (entry.estimate is None) != (entry.problem is None), entry
        assert "Traceback" not in (entry.problem or "")
    rows = {entry.name: entry for entry in result.optimizers}
    assert all(rows[name].estimate is not None for name in EXACT)
    assert {name for name, entry in rows.items() if entry.missing_package} == set(MISSING)
    if not torch.cuda.is_available():  # AdaLomo's constructor moves its second moments to CUDA
        # A CPU build of torch has no CUDA at all; a CUDA build finds no driver on this machine.
        assert rows["adalomo"].problem == (
            "its constructor failed: AssertionError: Torch not compiled with CUDA enabled" if torch.version.cuda is None
            else "its constructor failed: RuntimeError: Found no NVIDIA driver on your system. Please check that you "
            "have an NVIDIA GPU and installed a driver from http://www.nvidia.com/Download/index.aspx")
        assert rows["adalomo"].optimizer_class == "lomo_optim.adalomo.AdaLomo"


@requires_transformers("5.0", "transformers 4.x checks galore_torch's availability before importing it and "
                              "has no per-name handler to read the import from: the row gives the Trainer's "
                              "message without naming the package")
def test_a_missing_library_gets_a_row_naming_it(monkeypatch):
    # galore-torch is installed here; its absence is simulated the two ways the Trainer sees it:
    # its availability check says no, and importing it fails.
    import transformers.trainer_optimizer as trainer_optimizer

    monkeypatch.setattr(trainer_optimizer, "is_galore_torch_available", lambda: False)
    monkeypatch.setitem(sys.modules, "galore_torch", None)
    result = what_if(tiny_classifier(), "galore_adamw,adamw", optim_target_modules=TARGETS)
    galore, adamw = result.optimizers
    assert galore.missing_package == "galore_torch"
    assert galore.problem.startswith("needs the galore_torch package, not installed here (You need to install")
    assert galore.to_dict()["missing_package"] == "galore_torch"
    assert adamw.estimate.num_bytes == EXACT["adamw_torch"] and adamw.missing_package is None


def test_the_real_missing_libraries_are_named_from_the_trainers_own_imports(tmp_path):
    result = what_if(tiny_classifier(), list(MISSING))
    assert {entry.name: entry.missing_package for entry in result.optimizers} == MISSING
    with pytest.raises(OptimizerUnavailable) as raised:
        build_trainer_optimizer("adamw_anyprecision", training_args(str(tmp_path)), meta_stand_in(tiny_classifier()))
    assert (raised.value.missing_package, raised.value.problem) == (
        "torchdistx", "needs the torchdistx package, not installed here (Please install https://github.com/pytorch/torchdistx)")


def test_galore_without_target_modules_says_what_to_give():
    (entry,) = what_if(tiny_classifier(), ["galore_adamw"]).optimizers
    assert entry.problem.startswith("the Trainer cannot build it: You need to define `optim_target_modules`")
    (entry,) = what_if(tiny_classifier(), ["galore_adamw"], optim_target_modules="attention|ffn").optimizers
    # One string is matched against whole module names, so this one matches none.
    assert "No target modules found" in entry.problem and "re.fullmatch" in entry.problem


# -- optim_args and optim_target_modules ------------------------------------------------------------


def test_optim_args_and_target_modules_reach_the_optimizer_as_the_trainer_spells_them(tmp_path):
    built = build_trainer_optimizer(
        "galore_adamw",
        training_args(str(tmp_path), optim_args=parse_optim_args("rank=4, update_proj_gap=50,proj_type=left"),
                      optim_target_modules=parse_optim_target_modules("attention,ffn")),
        meta_stand_in(tiny_classifier()))
    others, targets = built.param_groups
    assert [tuple(p.shape) for p in targets["params"]] == [(16, 16)] * 4 + [(32, 16), (16, 32)]
    assert len(others["params"]) == 18
    assert (targets["rank"], targets["update_proj_gap"], targets["proj_type"], targets["scale"]) == (4, 50, "left", 0.25)
    # The same through what_if's keywords, which override the arguments' own.
    ademamix = build_trainer_optimizer("ademamix", training_args(str(tmp_path), optim_args="alpha=8,beta3=0.999"),
                                       meta_stand_in(tiny_classifier()))
    assert (ademamix.param_groups[0]["alpha"], ademamix.param_groups[0]["betas"]) == (8.0, (0.9, 0.999, 0.999))


def test_optim_args_and_target_modules_parse_or_name_the_bad_value():
    assert parse_optim_args(" rank = 64 , update_proj_gap=200,") == "rank=64,update_proj_gap=200"
    assert parse_optim_args({"rank": 64}) == "rank=64"
    assert parse_optim_args("") is None and parse_optim_args(None) is None
    for bad, piece in (("rank", "rank"), ("rank=64,gap", "gap"), ("=3", "=3"), ("rank=", "rank="),
                       ("a=b=c", "a=b=c"), ("1x=2", "1x=2")):
        with pytest.raises(ValueError, match=rf"^optim_args piece '{piece}' is not key=value; write them like "):
            parse_optim_args(bad)
    with pytest.raises(ValueError, match=r"optim_args=7: expected a string"):
        parse_optim_args(7)

    assert parse_optim_target_modules(".*(attn|mlp).*") == ".*(attn|mlp).*"
    assert parse_optim_target_modules("all-linear") == "all-linear"
    assert parse_optim_target_modules("attn, mlp") == ["attn", "mlp"]
    assert parse_optim_target_modules(("q_proj",)) == ["q_proj"]
    with pytest.raises(ValueError, match=r"optim_target_modules entry 'attn\(' is not a regular expression"):
        parse_optim_target_modules("attn(")
    with pytest.raises(ValueError, match=r"optim_target_modules has an empty entry"):
        parse_optim_target_modules("attn,,mlp")
    with pytest.raises(ValueError, match=r"optim_target_modules=\[3\]: expected a string or a list of strings"):
        parse_optim_target_modules([3])
    with pytest.raises(ValueError, match=r"optim_args piece 'rank' is not key=value"):
        what_if(tiny_classifier(), "galore_adamw", optim_args="rank")


def _fails(argv, capsys, *phrases):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    for phrase in phrases:
        assert phrase in err, err


def test_the_estimate_command_takes_optim_args_and_target_modules(tmp_path, capsys):
    import json

    model_dir = tmp_path / "tiny"
    tiny_classifier().config.save_pretrained(str(model_dir))
    assert main(["estimate", str(model_dir), "--architecture", "DistilBertForSequenceClassification",
                 "--optimizers", "adamw,galore_adamw,lion_32bit,adamw_torch_xla",
                 "--optim-args", "rank=4,update_proj_gap=50", "--optim-target-modules", "attention,ffn", "--json"]) == 0
    rows = {entry["name"]: entry for entry in json.loads(capsys.readouterr().out)["optimizers"]}
    assert rows["adamw_torch"]["estimate"]["num_bytes"] == EXACT["adamw_torch"]
    assert rows["lion_32bit"]["estimate"]["num_bytes"] == EXACT["lion_32bit"]
    assert rows["adamw_torch_xla"]["missing_package"] == "torch_xla"
    assert rows["galore_adamw"]["optimizer_class"] == "galore_torch.adamw.AdamW"
    # Until a rule for GaLore is registered its row says so; with one, it has a figure.
    assert (rows["galore_adamw"]["estimate"] is None) == (rows["galore_adamw"]["problem"] is not None)

    assert main(["estimate", str(model_dir), "--optimizers", "adamw_torch_npu_fused,adamw"]) == 0
    table = capsys.readouterr().out
    assert "needs the torch_npu package, not installed here" in table

    _fails(["estimate", str(model_dir), "--optim-args", "rank"], capsys,
           "argument --optim-args: optim_args piece 'rank' is not key=value")
    _fails(["estimate", str(model_dir), "--optim-target-modules", "attn("], capsys,
           "argument --optim-target-modules: optim_target_modules entry 'attn(' is not a regular expression")


def test_the_docstring_examples_run():
    import doctest

    import trainer_memcb.plan.model.lora
    import trainer_memcb.plan.settings.optim_options
    import trainer_memcb.plan.model.stand_ins
    import trainer_memcb.plan.optimizers.trainer_optimizers

    for module in (trainer_memcb.plan.model.lora, trainer_memcb.plan.settings.optim_options, trainer_memcb.plan.model.stand_ins,
                   trainer_memcb.plan.optimizers.trainer_optimizers):
        outcome = doctest.testmod(module)
        assert outcome.attempted > 0 and outcome.failed == 0, module.__name__


def test_the_stand_in_leaves_the_model_as_it_was():
    # The layer-wise variants hang a hook on every trainable parameter of the model they get, and
    # LOMO one on each; the what-if gives them the stand-in, so the model itself gets none.
    model = tiny_classifier()
    before = {name: (param.data_ptr(), param.requires_grad) for name, param in model.named_parameters()}
    result = what_if(model, "galore_adamw_layerwise,apollo_adamw_layerwise,lomo,adamw_8bit",
                     optim_target_modules=TARGETS)
    assert all(entry.problem is None or entry.problem.startswith("no estimate rule") for entry in result.optimizers)
    assert {name: (param.data_ptr(), param.requires_grad) for name, param in model.named_parameters()} == before
    for param in model.parameters():
        assert not param._post_accumulate_grad_hooks and not param._backward_hooks
    twin = meta_stand_in(model)
    assert [(name, type(module)) for name, module in twin.named_modules()] == [
        (name, type(module)) for name, module in model.named_modules()]
    assert all(param.device.type == "meta" for param in twin.parameters())
