"""The batch a Trainer hands a model of each task head, as transformers' collators make it.

`step_inputs` returns the tensors of one micro-batch for the model's class (its name's suffix and
its `main_input_name`), made in the current tensor mode (fake under the step plan):

| head | forward gets | collator it follows |
|---|---|---|
| causal LM (`...ForCausalLM`, `...LMHeadModel`), masked LM | `input_ids`, `labels` (B, S) | `DataCollatorForLanguageModeling` |
| sequence classification | `input_ids`, `labels` (B,) (fp32 with one label: regression) | `DataCollatorWithPadding` |
| token classification | `input_ids`, `labels` (B, S) | `DataCollatorForTokenClassification` |
| question answering | `input_ids`, `start_positions`, `end_positions` (B,) | `default_data_collator` |
| seq2seq (`config.is_encoder_decoder`, token inputs) | `input_ids` (B, S), `labels` (B, T), `decoder_input_ids` (B, T) where the model has `prepare_decoder_input_ids_from_labels` | `DataCollatorForSeq2Seq(model=model)` |
| speech seq2seq (`input_features`: Whisper) | `input_features` (B, mel bins, 2 x `max_source_positions`), `labels` (B, T) | the speech seq2seq collator of transformers' examples |
| image models (`pixel_values`) | `pixel_values` (B, channels, H, W), `labels` (B,) | `default_data_collator` |
| vision-language (`config.vision_config` and `text_config`, an image token: Llava) | `input_ids` (B, S) holding one image's placeholder tokens after the first, `pixel_values` (B, channels, H, W), `labels` (B, S) | the processor (`LlavaProcessor`), then a causal LM collator |

S is `seq_len`, T `target_len` (default S), H and W `image_size` (default the vision config's). The
floating inputs (pixel values, input features) are in the model's dtype, as a run must cast them.

Masks. A tokenizer gives an attention mask and the collators carry it: every token batch holds
one, (B, S) int64, and the forward gets it. Without padding it is all ones, and transformers then
takes the mask-free path (it reads the mask's values, which a fake tensor has not: the step plan
answers those reads as the real batch does, see `trainer_memcb.plan.model.value_reads`). With
`padding=P` (P padded positions per row, as `padding="longest"` leaves them) the mask has zeros
and the model builds its attention mask, in the real run as in the trace.

A vision-language model's text holds, per image, as many placeholder tokens (`image_token_id`) as
the vision tower makes features: `LlavaProcessor` (with `num_additional_image_tokens=1`, the CLS
token, as the llava-hf checkpoints set it) expands `<image>` to `(H / patch) x (W / patch) + 1`
tokens, less the CLS one under `vision_feature_select_strategy="default"`; S counts them. The forward
checks that count against the features and scatters the features into their places, reading the
ids' values: the plan's ids hold the placeholders where the processor puts them (after the BOS
token of a "USER: <image>..." prompt), so that the trace answers as the real batch does.

Options a model has no use for (`seq_len` for an image model, `target_len` for a decoder-only one,
`image_size` for a text model) raise `ValueError` naming the model and the option that applies; so
does a length past a learned position table (GPT-2's `wpe`, BERT's `position_embeddings`, BART's
`embed_positions`: a real batch would index past its rows; rotary positions have no such bound).
A token model whose config has no token (`vocab_size` below 1) raises `ModelConfigError`.

Packing. With `packing=TOKENS` a causal LM gets the padding-free batch `DataCollatorWithFlattening`
makes (transformers' `data/data_collator.py`): the micro-batch's sequences concatenated into one
row, `input_ids`, `labels` (each sequence's first label the separator, -100) and `position_ids`
(1, TOKENS) int64, the positions restarting at 0 with each sequence, and no attention mask. The
sequences are `seq_len` tokens each, `TOKENS // seq_len` of them, and the rest one shorter
sequence. Under `flash_attention_2` and `flash_attention_3` the collator is taken with `return_flash_attn_kwargs=True`,
as the varlen kernel wants it: `cu_seq_lens_q` and `cu_seq_lens_k` (the sequences' boundaries,
two int32 tensors of sequences + 1) and `max_length_q`, `max_length_k` (Python ints, `seq_len`);
without them transformers derives the boundaries from `position_ids` in every layer, reading
their values. With `sdpa` and `eager`, transformers' `create_causal_mask` finds the sequences from
the restarting positions (`masking_utils.find_packed_sequence_indices`, reached with no mask and
no cache) and masks attention across them: a (1, 1, TOKENS, TOKENS) mask per forward. Refused,
naming what would plan it: another head than a causal LM, another attention, a model whose mask
is not built from `position_ids`, a transformers or torch release without the packed mask.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Optional

import torch
from torch import nn

from trainer_memcb.plan.settings.attention import is_flash_path

__all__ = ["StepInputs", "step_inputs", "head_kind", "unwrap", "packed_lengths", "PACKED_ATTENTIONS"]

_TOKEN_LABELS = ("ForCausalLM", "ForMaskedLM", "LMHeadModel", "ForTokenClassification")


@dataclass
class StepInputs:
    """One micro-batch.

    Attributes:
        forward: the keyword arguments of the forward (the loss's inputs included): tensors, and
            the Python ints a packed batch gives flash attention (`max_length_q`, `max_length_k`).
        held: batch tensors the collator makes that the forward is not given (an all-ones mask).
        labels: the tensor the Trainer counts `num_items_in_batch` from, or None.
        kind: the head (see `head_kind`).
    """

    forward: Dict[str, torch.Tensor]
    held: Dict[str, torch.Tensor] = field(default_factory=dict)
    labels: Optional[torch.Tensor] = None
    kind: str = "causal_lm"

    def tensors(self) -> list:
        return [value for value in self.forward.values() if isinstance(value, torch.Tensor)] + list(self.held.values())


def unwrap(model: nn.Module) -> nn.Module:
    """The transformers model inside a PEFT model (or the model itself)."""
    if hasattr(model, "peft_config") and hasattr(model, "base_model"):
        return getattr(model.base_model, "model", model.base_model)
    return model


def head_kind(model: nn.Module) -> str:
    """The task head of `model`: causal_lm, masked_lm, sequence_classification,
    token_classification, question_answering, seq2seq, speech_seq2seq, image, vision_language or base."""
    inner = unwrap(model)
    name = type(inner).__name__
    config = getattr(inner, "config", None)
    main_input = getattr(inner, "main_input_name", "input_ids")
    if main_input == "input_features":
        return "speech_seq2seq"
    if main_input == "pixel_values":
        return "image"
    if config is not None and _image_token(config) is not None and hasattr(config, "vision_config") \
            and hasattr(config, "text_config"):
        return "vision_language"
    if config is not None and getattr(config, "is_encoder_decoder", False):
        return "seq2seq"
    if name.endswith("ForMaskedLM"):
        return "masked_lm"
    if name.endswith(("ForCausalLM", "LMHeadModel")):
        return "causal_lm"
    if name.endswith("ForSequenceClassification"):
        return "sequence_classification"
    if name.endswith("ForTokenClassification"):
        return "token_classification"
    if name.endswith("ForQuestionAnswering"):
        return "question_answering"
    return "base"


def _image_token(config: Any) -> Optional[int]:
    token = getattr(config, "image_token_id", None)
    return token if token is not None else getattr(config, "image_token_index", None)


def image_tokens(config: Any, height: int, width: int) -> int:
    """The placeholder tokens a Llava processor puts in the text per image (module docstring)."""
    vision = config.vision_config
    patch = vision.patch_size
    tokens = (height // patch) * (width // patch) + 1  # the patches and the CLS token
    if getattr(config, "vision_feature_select_strategy", "default") == "default":
        tokens -= 1  # the CLS token's feature is dropped
    return tokens


def _position_table(model: nn.Module) -> Optional[str]:
    """The name of a learned absolute position table (an `nn.Embedding` named for positions), or None."""
    for name, module in model.named_modules():
        last = name.rpartition(".")[2]
        if isinstance(module, nn.Embedding) and ("pos" in last or last == "wpe"):
            return name
    return None


def _check_lengths(model: nn.Module, name: str, lengths: Dict[str, Optional[int]]) -> None:
    """Token ids need a vocabulary, and a learned position table bounds the lengths."""
    from trainer_memcb.plan.model.config_error import ModelConfigError

    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    vocab = getattr(text, "vocab_size", None)
    if isinstance(vocab, int) and vocab < 1:
        raise ModelConfigError(f"{name}'s config has vocab_size={vocab}: a model of token inputs needs at least 1 "
                               "token (its ids are 0 to vocab_size - 1)")
    limit = getattr(text, "max_position_embeddings", None)
    table = _position_table(model)
    if table is None or not isinstance(limit, int):
        return
    key = getattr(text, "attribute_map", {}).get("max_position_embeddings", "max_position_embeddings")  # GPT-2: n_positions
    for option, length in lengths.items():
        if length is not None and length > limit:
            raise ValueError(f"{option} {length} is past {name}'s {limit} positions ({key} in its config; its learned "
                             f"position table {table} has no row beyond): give at most {limit}")


def _float_dtype(model: nn.Module) -> torch.dtype:
    for param in model.parameters():
        if param.is_floating_point():
            return param.dtype
    return torch.float32


def _image_size(config: Any, image_size: Optional[int]) -> tuple:
    if image_size is not None:
        return image_size, image_size
    size = getattr(config, "image_size", None)
    if size is None and hasattr(config, "vision_config"):
        size = getattr(config.vision_config, "image_size", None)
    if size is None:
        raise ValueError(f"{type(config).__name__} has no image_size: give --image-size")
    return (size, size) if isinstance(size, int) else tuple(size)


# The heads whose inputs are not tokens: images, and audio features.
_TOKENLESS = ("image", "speech_seq2seq")


def step_inputs(model: nn.Module, batch_size: int, seq_len: Optional[int] = None, *, target_len: Optional[int] = None,
                image_size: Optional[int] = None, padding: int = 0, packing: Optional[int] = None) -> StepInputs:
    """The micro-batch a Trainer gives `model` (see the module docstring), made in the current mode.

    Args:
        model: the model (a PEFT model is looked through).
        batch_size: B.
        seq_len: S, the token inputs' length (refused for image and speech models).
        target_len: T, the labels' length of a seq2seq model (default S).
        image_size: the images' height and width (default the config's).
        padding: padded positions per row of the token inputs.
        packing: a causal LM's padding-free row of this many tokens (module docstring); `batch_size` 1.

    Raises:
        ValueError: an option the model has no use for, or one it needs that is missing, or a length
            past a learned position table.
        ModelConfigError: a token model whose config has no token (vocab_size below 1).
    """
    inner = unwrap(model)
    name = type(inner).__name__
    config = getattr(inner, "config", None)
    kind = head_kind(model)
    takes_tokens = kind not in _TOKENLESS
    _check_options(name, kind, seq_len, target_len, image_size, padding)
    if packing is not None:
        _check_packing(inner, name, kind, batch_size, seq_len, packing)
        _check_lengths(inner, name, {"--seq-len": seq_len})
        return _packed_inputs(config, seq_len, packing)
    if takes_tokens:
        _check_lengths(inner, name, {"--seq-len": seq_len, "--target-len": target_len if kind == "seq2seq" else None})
    long = dict(dtype=torch.long)
    forward: Dict[str, torch.Tensor] = {}
    held: Dict[str, torch.Tensor] = {}
    labels = None
    if takes_tokens:
        forward["input_ids"] = torch.zeros(batch_size, seq_len, **long)
        forward["attention_mask"] = torch.ones(batch_size, seq_len, **long)
    if kind in ("causal_lm", "masked_lm", "token_classification"):
        labels = forward["labels"] = torch.zeros(batch_size, seq_len, **long)
    elif kind == "sequence_classification":
        regression = getattr(config, "num_labels", 2) == 1
        labels = forward["labels"] = torch.zeros(batch_size, dtype=torch.float32 if regression else torch.long)
    elif kind == "question_answering":
        forward["start_positions"] = torch.zeros(batch_size, **long)
        forward["end_positions"] = torch.zeros(batch_size, **long)
    elif kind in ("seq2seq", "speech_seq2seq"):
        labels = _add_seq2seq_inputs(forward, model, name, kind, batch_size, seq_len, target_len)
    elif kind == "vision_language":
        labels = _add_vision_language_inputs(forward, model, name, batch_size, seq_len, image_size, padding)
    elif kind == "image":
        height, width = _image_size(config, image_size)
        channels = getattr(config, "num_channels", 3)
        forward["pixel_values"] = torch.zeros(batch_size, channels, height, width, dtype=_float_dtype(model))
        if name.endswith("ForImageClassification"):
            labels = forward["labels"] = torch.zeros(batch_size, **long)
    return StepInputs(forward=forward, held=held, labels=labels, kind=kind)


def packed_lengths(seq_len: int, packing: int) -> list:
    """The lengths of the sequences of a packed row: `packing // seq_len` of `seq_len`, and the rest."""
    full, rest = divmod(packing, seq_len)
    return [seq_len] * full + ([rest] if rest else [])


def _packed_inputs(config: Any, seq_len: int, packing: int) -> StepInputs:
    """`DataCollatorWithFlattening`'s batch (module docstring), in the current mode."""
    long = dict(dtype=torch.long)
    forward: Dict[str, torch.Tensor] = {"input_ids": torch.zeros(1, packing, **long),
                                        "labels": torch.zeros(1, packing, **long)}
    forward["position_ids"] = torch.cat([torch.arange(length, **long) for length in packed_lengths(seq_len, packing)])[None]
    if is_flash_path(getattr(config, "_attn_implementation", None)):
        bounds = [0]
        for length in packed_lengths(seq_len, packing):
            bounds.append(bounds[-1] + length)
        # The collator converts the one list twice: two tensors.
        forward["cu_seq_lens_q"] = torch.tensor(bounds, dtype=torch.int32)
        forward["cu_seq_lens_k"] = torch.tensor(bounds, dtype=torch.int32)
        forward["max_length_q"] = forward["max_length_k"] = seq_len  # type: ignore[assignment]
    return StepInputs(forward=forward, labels=forward["labels"], kind="causal_lm")


# The attentions a packed row is planned with, and what each does with it (and the hub's flash-attn 2
# kernels, `HUB_FLASH_ATTN_2`, as flash_attention_2).
PACKED_ATTENTIONS = ("sdpa", "eager", "flash_attention_2", "flash_attention_3")



def _check_packing(model: nn.Module, name: str, kind: str, batch_size: int, seq_len: Optional[int],
                   packing: int) -> None:
    """Refuse a packed row that transformers would not keep apart (module docstring), naming what would."""
    import inspect

    if kind != "causal_lm":
        raise ValueError(f"--packing: {name} is not a causal LM; padding-free batches are planned for causal LMs "
                         "(DataCollatorWithFlattening's labels and restarting positions)")
    if batch_size != 1:
        raise ValueError(f"--packing makes the micro-batch one row: batch size {batch_size} has no meaning with it")
    if seq_len is not None and packing < seq_len:
        raise ValueError(f"--packing {packing} is fewer tokens than one sequence of --seq-len {seq_len}")
    config = getattr(model, "config", None)
    attention = getattr(config, "_attn_implementation", None)
    if attention not in PACKED_ATTENTIONS and not is_flash_path(attention):
        raise ValueError(f"--packing with attention {attention!r}: packed rows are planned with "
                         f"{', '.join(PACKED_ATTENTIONS)} (give --attn-implementation)")
    forward = getattr(type(model), "forward", None)
    takes_kwargs = forward is not None and any(
        parameter.kind is inspect.Parameter.VAR_KEYWORD for parameter in inspect.signature(forward).parameters.values())
    if is_flash_path(attention):
        if not takes_kwargs:
            raise ValueError(f"--packing with {attention}: {name}'s forward takes no keyword arguments for the "
                             "attention (cu_seq_lens_q, max_length_q, ...); sdpa or eager may plan it")
        return
    from trainer_memcb.plan.model.packed_mask import packed_mask_missing

    missing = packed_mask_missing(model)
    if missing:
        raise ValueError(f"--packing with {attention}: {missing}; flash_attention_2 (on CUDA) would keep the "
                         "sequences apart")


def _check_options(name: str, kind: str, seq_len: Optional[int], target_len: Optional[int],
                   image_size: Optional[int], padding: int) -> None:
    """Refuse an option the head has no use for, or a missing one it needs, before any tensor is
    made: a plan with a length that means nothing to the model would answer another question
    than the one asked. The messages name the flags, which is where these options come from."""
    takes_tokens = kind not in _TOKENLESS
    if not takes_tokens and seq_len is not None:
        applies = "--image-size (default: the config's)" if kind == "image" else "--target-len (the labels' length)"
        raise ValueError(f"{name} takes {'images' if kind == 'image' else 'audio features'}, not tokens: "
                         f"--seq-len has no meaning for it; {applies} applies")
    if takes_tokens and seq_len is None:
        raise ValueError(f"{name} takes tokens: give --seq-len (the sequence length)")
    if target_len is not None and kind not in ("seq2seq", "speech_seq2seq"):
        raise ValueError(f"{name} is not a sequence-to-sequence model: --target-len has no meaning for it; "
                         f"--seq-len applies")
    if image_size is not None and kind not in ("image", "vision_language"):
        raise ValueError(f"{name} takes no images: --image-size has no meaning for it")
    if padding and not takes_tokens:
        raise ValueError(f"{name} takes no tokens: --padding has no meaning for it")
    if takes_tokens and not 0 <= padding < seq_len:
        raise ValueError(f"padding={padding!r}: expected a whole number from 0 to seq_len - 1 ({seq_len - 1})")


def _add_seq2seq_inputs(forward: Dict[str, torch.Tensor], model: nn.Module, name: str, kind: str, batch_size: int,
                        seq_len: Optional[int], target_len: Optional[int]) -> torch.Tensor:
    """Add a (speech) sequence-to-sequence model's labels and decoder inputs, as
    `DataCollatorForSeq2Seq(model=...)` makes them, and Whisper's audio features; the labels
    returned. Their length is the target's, which for audio has no default to fall back on."""
    inner = unwrap(model)
    config = getattr(inner, "config", None)
    long = dict(dtype=torch.long)
    target = target_len if target_len is not None else seq_len
    if target is None:
        raise ValueError(f"{name} is a sequence-to-sequence model: give --target-len (the labels' length)")
    labels = forward["labels"] = torch.zeros(batch_size, target, **long)
    if hasattr(inner, "prepare_decoder_input_ids_from_labels"):
        # DataCollatorForSeq2Seq(model=...): the decoder inputs are the labels shifted right.
        forward["decoder_input_ids"] = torch.zeros(batch_size, target, **long)
    if kind == "speech_seq2seq":
        frames = 2 * config.max_source_positions  # Whisper's two convolutions, the second with stride 2
        forward["input_features"] = torch.zeros(batch_size, config.num_mel_bins, frames, dtype=_float_dtype(model))
    return labels


def _add_vision_language_inputs(forward: Dict[str, torch.Tensor], model: nn.Module, name: str, batch_size: int,
                                seq_len: int, image_size: Optional[int], padding: int) -> torch.Tensor:
    """Add a vision-language model's images and its text's image placeholders, as its processor
    puts them (module docstring), and the labels, returned: the placeholders' count is read by
    the model, so the text must hold them all, refused when `seq_len` is too short for them."""
    config = getattr(unwrap(model), "config", None)
    height, width = _image_size(config, image_size)
    placeholders = image_tokens(config, height, width)
    if placeholders + 1 > seq_len - padding:
        raise ValueError(f"seq_len={seq_len!r}: {name} puts {placeholders} image tokens and a BOS token in the "
                         f"text of each {height}x{width} image: give at least {placeholders + 1 + padding}")
    # The processor's ids: BOS, the image's placeholders, then text (values of a fake tensor are
    # not read, but these are: the placeholder mask and its count).
    ids = forward["input_ids"]
    ids[:, 1:1 + placeholders] = _image_token(config)
    labels = forward["labels"] = torch.zeros(batch_size, seq_len, dtype=torch.long)
    vision = config.vision_config
    forward["pixel_values"] = torch.zeros(batch_size, getattr(vision, "num_channels", 3), height, width,
                                          dtype=_float_dtype(model))
    return labels
