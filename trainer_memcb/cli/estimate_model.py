"""The model the options of `trainer-memcb estimate` describe, built on the meta device (LoRA
adapters and trainable names applied), the base model's quantization (QLoRA), and the builder the
step's traces take their models from."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from trainer_memcb.cli.estimate_request import EstimateRequest
from trainer_memcb.cli.progress import say_progress

if TYPE_CHECKING:
    from trainer_memcb.plan.model.quantized import Quantization

__all__ = ["estimate_model", "check_lora_options", "quantization_of", "quantization_asked", "first_then_new"]


def estimate_model(args: EstimateRequest) -> Any:
    """The model the options describe, on the meta device: LoRA adapters and trainable names applied.

    Raises:
        ValueError: an unknown architecture, a bad regular expression, LoRA options without
            --lora-r, LoRA modules PEFT cannot find.
        ModelConfigError: no model config, or no parameter left to train.
    """
    from trainer_memcb.plan.model.lora import add_lora_adapters
    from trainer_memcb.plan.optimizers.whatif import ModelConfigError, build_meta_model, resolve_dtype, select_trainable

    check_lora_options(args)
    say_progress(f"building {args.model} on the meta device")
    model = build_meta_model(args.model, resolve_dtype(args.dtype or "float32"), args.architecture)
    if args.lora_r is not None:
        model = add_lora_adapters(model, args.lora_r, args.lora_target_modules, args.lora_modules_to_save)
    if args.trainable is not None:
        if select_trainable(model, args.trainable, narrow=args.lora_r is not None) == 0:
            names = [name for name, _ in model.named_parameters()][:3]
            raise ModelConfigError(f"no parameter name of {args.model} matches --trainable {args.trainable!r}; "
                                   f"names look like: {', '.join(names)}")
    return model


def check_lora_options(args: EstimateRequest) -> None:
    if args.lora_r is None and (args.lora_target_modules is not None or args.lora_modules_to_save is not None):
        raise ValueError("--lora-target-modules and --lora-modules-to-save need --lora-r (the adapters' rank)")


def quantization_of(args: EstimateRequest) -> Optional[Quantization]:
    """The base model's loading (QLoRA), or None.

    Raises:
        ValueError: both --load-in-4bit and --load-in-8bit, or an option of the other one, or
            either without --lora-r.
    """
    if not quantization_asked(args):
        return None
    from trainer_memcb.plan.model.quantized import Quantization
    from trainer_memcb.plan.optimizers.whatif import resolve_dtype

    if getattr(args, "load_in_8bit", False):
        threshold = getattr(args, "llm_int8_threshold", None)
        return Quantization(bits=8, threshold=6.0 if threshold is None else threshold)
    return Quantization(quant_type=args.bnb_4bit_quant_type, double_quant=args.bnb_4bit_use_double_quant,
                        compute_dtype=resolve_dtype(args.bnb_4bit_compute_dtype))


def quantization_asked(args: EstimateRequest) -> bool:
    """Whether the options load the base model quantized, once its options are checked (from the
    command line alone, before torch is imported).

    Raises:
        ValueError: both --load-in-4bit and --load-in-8bit, or an option of the other one, or
            either without --lora-r.
    """
    threshold = getattr(args, "llm_int8_threshold", None)
    if getattr(args, "load_in_8bit", False):
        if getattr(args, "load_in_4bit", False):
            raise ValueError("--load-in-8bit and --load-in-4bit: give one (BitsAndBytesConfig loads in one of them)")
        four_bit = [flag for flag, given in (("--bnb-4bit-use-double-quant", args.bnb_4bit_use_double_quant),
                                             ("--bnb-4bit-quant-type", args.bnb_4bit_quant_type != "nf4"),
                                             ("--bnb-4bit-compute-dtype", args.bnb_4bit_compute_dtype != "float32"))
                    if given]
        if four_bit:
            raise ValueError(f"{four_bit[0]} is an option of --load-in-4bit, not of --load-in-8bit")
        if threshold is not None and not threshold >= 0:  # NaN too: no outlier column would ever be found
            raise ValueError(f"--llm-int8-threshold {threshold!r}: expected a number of at least 0 (default 6.0)")
        _needs_adapters(args, "--load-in-8bit")
        return True
    if threshold is not None:
        raise ValueError("--llm-int8-threshold is an option of --load-in-8bit")
    if not getattr(args, "load_in_4bit", False):
        return False
    _needs_adapters(args, "--load-in-4bit")
    return True


def _needs_adapters(args: EstimateRequest, flag: str) -> None:
    """transformers' trainer_utils.validate_quantization_for_training, called by Trainer.__init__:
    a quantized base model trains only with adapters."""
    if getattr(args, "lora_r", None) is None:
        raise ValueError(f"{flag} needs --lora-r: the Trainer refuses to train a purely quantized model "
                         "(\"You cannot perform fine-tuning on purely quantized models\"); QLoRA trains adapters on it")


def first_then_new(model: Any, build: Any) -> Any:
    """A model builder for the traces: `model` the first time, `build()` each time after.

    A trace makes the model it is given fake in place, so no two traces may share one; the model
    the options were checked and the model states planned on is still untouched then (the
    states plan works on a stand-in), and building it again costs 0.1-0.25 s for a 70B config."""
    unused = [model]

    def next_model() -> Any:
        return unused.pop() if unused else build()

    return next_model
