"""The model as the Trainer prepares it: each setting against what a real Trainer does."""

from __future__ import annotations

import pytest
import torch

from helpers import installed_version, requires_transformers, training_args
from trainer_memcb.plan.model.trainer_model import checkpointing_kwargs, prepare_like_trainer, reentrant_by_default

transformers = pytest.importorskip("transformers")
from transformers import LlamaConfig, LlamaForCausalLM, Trainer  # noqa: E402


def tiny() -> torch.nn.Module:
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                         vocab_size=64, max_position_embeddings=32)
    assert config.use_cache is True  # the config's default, which the Trainer overrides
    return LlamaForCausalLM(config).eval()


@requires_transformers("5.0", "TrainingArguments.use_cache, which the Trainer sets on the model's config")
@pytest.mark.parametrize("use_cache", [False, True])
def test_use_cache_is_the_arguments_as_a_real_trainer_sets_it(tmp_path, use_cache: bool) -> None:
    args = training_args(str(tmp_path), use_cache=use_cache)
    real = Trainer(model=tiny(), args=args).model
    planned = prepare_like_trainer(tiny(), args=args)
    assert planned.config.use_cache is real.config.use_cache is use_cache


def test_use_cache_is_what_the_installed_trainer_leaves(tmp_path) -> None:
    # transformers 5 sets the arguments' (False by default); 4.57 keeps the config's (True).
    args = training_args(str(tmp_path))
    real = Trainer(model=tiny(), args=args).model
    assert real.config.use_cache is (installed_version("transformers") < (5,))
    assert prepare_like_trainer(tiny(), args=args).config.use_cache is real.config.use_cache
    assert prepare_like_trainer(tiny()).config.use_cache is real.config.use_cache


def test_without_arguments_the_trainers_defaults_apply() -> None:
    model = prepare_like_trainer(tiny(), attn_implementation="eager")
    assert model.config.use_cache is (installed_version("transformers") < (5,))
    assert model.config._attn_implementation == "eager"
    assert model.training and all(module.training for module in model.modules())
    assert model.model.layers[0].gradient_checkpointing is False


@requires_transformers("5.0", "transformers 4.x names them gradient_checkpointing_kwargs only")
def test_checkpointing_takes_the_arguments_keywords(tmp_path) -> None:
    assert checkpointing_kwargs() == {"use_reentrant": False}
    args = training_args(str(tmp_path), activation_checkpointing=True,
                         activation_checkpointing_kwargs={"use_reentrant": True})
    assert checkpointing_kwargs(args) == {"use_reentrant": True}
    model = prepare_like_trainer(tiny(), args=args, gradient_checkpointing=True)
    layer = model.model.layers[0]
    assert layer.gradient_checkpointing is True
    assert layer._gradient_checkpointing_func.keywords == {"use_reentrant": True}
    assert prepare_like_trainer(tiny(), gradient_checkpointing=True).model.layers[0] \
        ._gradient_checkpointing_func.keywords == {"use_reentrant": False}


def test_without_keywords_checkpointing_is_what_the_installed_trainer_turns_on() -> None:
    # As `Trainer` calls it with the arguments' default (None): transformers 5
    # `activation_checkpointing_enable(activation_checkpointing_kwargs=None)`, 4.x
    # `gradient_checkpointing_enable(gradient_checkpointing_kwargs=None)`.
    real = tiny()
    if hasattr(real, "activation_checkpointing_enable"):
        real.activation_checkpointing_enable(activation_checkpointing_kwargs=None)
    else:
        real.gradient_checkpointing_enable(gradient_checkpointing_kwargs=None)
    real_keywords = real.model.layers[0]._gradient_checkpointing_func.keywords
    assert real_keywords == {"use_reentrant": installed_version("transformers") < (5,)}
    assert checkpointing_kwargs() == real_keywords == {"use_reentrant": reentrant_by_default()}
    planned = prepare_like_trainer(tiny(), gradient_checkpointing=True)
    assert planned.model.layers[0]._gradient_checkpointing_func.keywords == real_keywords


def test_keywords_for_torch_without_use_reentrant_leave_it_to_torchs_default() -> None:
    # `checkpoint(use_reentrant=None)` warns and runs reentrantly (torch 2.6 to 2.13), whatever the
    # release of transformers; transformers 5's own keys are not torch's.
    assert checkpointing_kwargs(given={"preserve_rng_state": False}) == {"preserve_rng_state": False,
                                                                        "use_reentrant": True}
    assert checkpointing_kwargs(given={"every_n_layers": 2}) == {"every_n_layers": 2,
                                                                 "use_reentrant": reentrant_by_default()}
    assert checkpointing_kwargs(given={"use_reentrant": False}) == {"use_reentrant": False}
    # The keywords given win over the arguments'.
    assert checkpointing_kwargs({"gradient_checkpointing_kwargs": {"use_reentrant": True}},
                                given={"use_reentrant": False}) == {"use_reentrant": False}
    assert checkpointing_kwargs({"gradient_checkpointing_kwargs": {"use_reentrant": True}}) == {"use_reentrant": True}


@requires_transformers("5.0", "every_n_layers is a key of transformers 5's activation_checkpointing_kwargs")
def test_every_n_layers_checkpoints_the_layers_the_trainer_checkpoints(tmp_path) -> None:
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                         vocab_size=64, max_position_embeddings=32)
    args = training_args(str(tmp_path), activation_checkpointing=True,
                         activation_checkpointing_kwargs={"every_n_layers": 2, "use_reentrant": False})
    real = Trainer(model=LlamaForCausalLM(config), args=args).model
    trainer_kwargs = dict(args.activation_checkpointing_kwargs)  # as Trainer.train() splits them
    real.activation_checkpointing_enable(every_n_layers=trainer_kwargs.pop("every_n_layers"),
                                         activation_checkpointing_kwargs=trainer_kwargs)
    planned = prepare_like_trainer(LlamaForCausalLM(config), args=args, gradient_checkpointing=True)
    flags = [layer.gradient_checkpointing for layer in planned.model.layers]
    assert flags == [layer.gradient_checkpointing for layer in real.model.layers]
    assert flags.count(True) == 2
