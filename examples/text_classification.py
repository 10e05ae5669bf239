"""The task every example trains: binary sentiment of short film reviews, offline by default.

Shared by `train_with_trainer.py`, `train_with_accelerate.py` and `compare_optimizers.py`:

- data: `examples/data/reviews/{train,validation}.csv`, loaded through `datasets`;
- model and tokenizer: `load_model()`, from a shipped config with random weights and a tokenizer
  built from the training texts, or from real weights when a hub name or a local folder has them;
- metrics: accuracy and F1 through `evaluate`, from the modules in `examples/metrics/`;
- optimizers: the three of the comparison, by name, for the Trainer and for a custom loop.
"""

from __future__ import annotations

import argparse
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Set

import numpy as np
import torch

EXAMPLES_DIR = Path(__file__).resolve().parent
DATA_DIR = EXAMPLES_DIR / "data" / "reviews"
METRICS_DIR = EXAMPLES_DIR / "metrics"
MODELS_DIR = EXAMPLES_DIR / "models"

TINY_MODEL = "tiny-distilbert"
# The distilbert-base-cased architecture, built offline from its shipped config.json.
DISTILBERT_ARCHITECTURE = str(MODELS_DIR / "distilbert-base-cased")
# Shipped configs with no hub repository behind them: never looked up online.
LOCAL_ONLY_MODELS = {TINY_MODEL}
WEIGHT_FILES = (
    "model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json"
)
NUM_LABELS = 2
# Reviews are at most 16 words; 64 tokens leave room for other texts without wasting compute.
MAX_LENGTH = 64
SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")

# What other libraries log when they are imported on a machine without their compiled kernels, or
# beside a newer torch: none of it concerns these examples, and it came first in every example's
# output (the Trainer imports peft, and peft bitsandbytes and torchao). Each notice is dropped by
# its logger and the start of its message; everything else those loggers say passes.
IMPORT_NOTICES = (
    # bitsandbytes/backends/cpu/ops.py, on a CPU with AVX-512 BF16: a 4-bit matmul kernel from the
    # hub (the examples train no 4-bit model).
    ("bitsandbytes.backends.cpu.ops", "Failed to load CPU gemm_4bit_forward"),
    # kernels/_internals/hf_hub.py (transformers 5.25 and later install `kernels`): the same
    # kernel's publisher, not checked while the hub is offline.
    ("kernels._internals.hf_hub", "Skipping publisher trust check"),
    # torchao/__init__.py: its optional compiled kernels (_C_mxfp8, _C_cutlass_90a), built for
    # another Python or for CUDA.
    ("torchao", "Failed to load "),
    # torch/utils/_pytree.py register_constant: torchao registering its enums (KernelPreference,
    # ScaleCalculationMode) as torch 2.13 deprecates it.
    ("torch.utils._pytree", "%s is an Enum subclass"),
    # deepspeed/accelerator/real_accelerator.py on a machine without a GPU (the DDP/ZeRO examples).
    ("DeepSpeed", "Setting accelerator to CPU"),
)


def _drops(prefix: str) -> Callable[[logging.LogRecord], bool]:
    def keep(record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(prefix)

    return keep


# Before transformers (and through it bitsandbytes and torchao) is imported: the loggers are the
# same objects then.
for _logger_name, _prefix in IMPORT_NOTICES:
    logging.getLogger(_logger_name).addFilter(_drops(_prefix))

__all__ = [
    "OPTIMIZERS",
    "LoadedModel",
    "OptimizerChoice",
    "Scores",
    "add_optimizer_argument",
    "example_parser",
    "load_model",
    "load_reviews",
    "parse_optimizer_names",
    "positive_int",
    "tokenize_reviews",
]


# -- data ------------------------------------------------------------------------------------------


def load_reviews(eval_samples: Optional[int] = None, train_samples: Optional[int] = None) -> Any:
    """The shipped reviews as a `datasets.DatasetDict` with `train` and `validation` splits."""
    from datasets import load_dataset

    data_files = {"train": str(DATA_DIR / "train.csv"), "validation": str(DATA_DIR / "validation.csv")}
    reviews = load_dataset("csv", data_files=data_files)
    if train_samples is not None:
        reviews["train"] = reviews["train"].select(range(min(train_samples, len(reviews["train"]))))
    if eval_samples is not None:
        reviews["validation"] = reviews["validation"].select(range(min(eval_samples, len(reviews["validation"]))))
    return reviews


def tokenize_reviews(reviews: Any, tokenizer: Any, max_length: int) -> Any:
    """Token ids and attention masks in place of the text; padding is left to the collator."""

    def tokenize(batch: Dict[str, List[Any]]) -> Dict[str, Any]:
        return tokenizer(batch["text"], truncation=True, max_length=max_length)

    return reviews.map(tokenize, batched=True, remove_columns=["text"])


# -- model and tokenizer ---------------------------------------------------------------------------


@dataclass
class LoadedModel:
    """A sequence classifier, its tokenizer, and a line saying how they were obtained."""

    model: Any
    tokenizer: Any
    origin: str

    @property
    def max_length(self) -> int:
        return min(MAX_LENGTH, getattr(self.model.config, "max_position_embeddings", MAX_LENGTH))


def local_tokenizer(texts: Iterable[str]) -> Any:
    """A word-level tokenizer trained on `texts`, lower-cased, with BERT's special tokens.

    Built with the `tokenizers` library in a fraction of a second, so nothing is downloaded.
    """
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    # No progress bar: it takes milliseconds, and with an iterator of unknown length its bar reads "410 / 0".
    tokenizer.train_from_iterator(
        texts, trainers.WordLevelTrainer(special_tokens=list(SPECIAL_TOKENS), show_progress=False)
    )
    cls_id, sep_id = tokenizer.token_to_id("[CLS]"), tokenizer.token_to_id("[SEP]")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]",
        sep_token="[SEP]", mask_token="[MASK]", model_input_names=["input_ids", "attention_mask"],
    )


# Names whose hub lookup failed in this process.
_UNREACHABLE: Set[str] = set()


def _has_weights(folder: Path) -> bool:
    return any((folder / name).is_file() for name in WEIGHT_FILES)


def _from_config(folder: Path, texts: Sequence[str], seed: int) -> LoadedModel:
    from transformers import AutoConfig, AutoModelForSequenceClassification

    config = AutoConfig.from_pretrained(str(folder), num_labels=NUM_LABELS)
    tokenizer = local_tokenizer(texts)
    if len(tokenizer) > config.vocab_size:
        raise ValueError(
            f"the local tokenizer needs {len(tokenizer)} token ids but {folder}/config.json has "
            f"vocab_size={config.vocab_size}; raise vocab_size to at least {len(tokenizer)}"
        )
    torch.manual_seed(seed)  # the random weights are the same on every run with this seed
    model = AutoModelForSequenceClassification.from_config(config)
    config_file = os.path.relpath(folder / "config.json")  # short and machine-independent when under the cwd
    if config_file.startswith(os.pardir):
        config_file = str(folder / "config.json")
    origin = (f"built from {config_file} with random weights; "
              f"word-level tokenizer of {len(tokenizer)} tokens built from the training texts")
    return LoadedModel(model, tokenizer, origin)


def _from_pretrained(name: str) -> LoadedModel:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(name, num_labels=NUM_LABELS)
    return LoadedModel(model, AutoTokenizer.from_pretrained(name), f"pretrained weights and tokenizer from {name}")


def load_model(name: str, texts: Sequence[str], seed: int = 0) -> LoadedModel:
    """A 2-label sequence classifier for `name`.

    Args:
        name: a local folder (real weights when it holds them, else its `config.json` with random
            weights), a shipped config's name (`tiny-distilbert`, always offline;
            `distilbert-base-cased`, from the hub when it is reachable and `HF_HUB_OFFLINE` is not
            set, else from its shipped config), or any hub name.
        texts: the training texts, for the local tokenizer a config-only build needs.
        seed: seeds the random weights of a config-only build.
    """
    try:
        from huggingface_hub import is_offline_mode  # huggingface_hub >= 1.0 (transformers 5)
    except ImportError:  # every transformers 4.x pins huggingface_hub below 1.0, which lacks it
        from transformers.utils import is_offline_mode

    folder = Path(name)
    if folder.is_dir():
        return _from_pretrained(name) if _has_weights(folder) else _from_config(folder, texts, seed)
    shipped = MODELS_DIR / name
    if not (shipped / "config.json").is_file():
        return _from_pretrained(name)
    if name in LOCAL_ONLY_MODELS or name in _UNREACHABLE or is_offline_mode():
        return _from_config(shipped, texts, seed)
    try:
        return _from_pretrained(name)
    except OSError as error:  # the hub is unreachable: the architecture is still here
        _UNREACHABLE.add(name)  # the comparison loads the model once per optimizer: ask once
        print(f"Could not load {name} from the hub ({str(error).splitlines()[0]}); "
              f"building its architecture offline instead (set HF_HUB_OFFLINE=1 to skip the attempt).")
        return _from_config(shipped, texts, seed)


# -- metrics ---------------------------------------------------------------------------------------


class Scores:
    """Accuracy and F1 through `evaluate`, from the metric modules shipped in `examples/metrics/`."""

    def __init__(self) -> None:
        import evaluate

        self.accuracy = evaluate.load(str(METRICS_DIR / "accuracy"))
        self.f1 = evaluate.load(str(METRICS_DIR / "f1"))

    def __call__(self, predictions: Sequence[int], references: Sequence[int]) -> Dict[str, float]:
        scores = self.accuracy.compute(predictions=predictions, references=references)
        scores.update(self.f1.compute(predictions=predictions, references=references))
        return scores

    def compute_metrics(self, eval_prediction: Any) -> Dict[str, float]:
        """For `Trainer(compute_metrics=...)`: logits and labels in, `accuracy` and `f1` out."""
        predictions = np.argmax(eval_prediction.predictions, axis=-1)
        return self(predictions, eval_prediction.label_ids)


# -- optimizers ------------------------------------------------------------------------------------


# The custom-loop optimizers are built as the Trainer builds them by default: no weight decay.


def _adamw(params: Any, lr: float) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.0)


def _adafactor(params: Any, lr: float) -> torch.optim.Optimizer:
    from transformers.optimization import Adafactor

    # What the Trainer's optim="adafactor" builds: a fixed learning rate, no relative step.
    return Adafactor(params, lr=lr, scale_parameter=False, relative_step=False)


def _adamw_8bit(params: Any, lr: float) -> torch.optim.Optimizer:
    import bitsandbytes as bnb

    return bnb.optim.AdamW8bit(params, lr=lr, weight_decay=0.0)


@dataclass(frozen=True)
class OptimizerChoice:
    """One optimizer of the lesson.

    Attributes:
        name: the name the examples take on the command line.
        trainer_optim: `TrainingArguments(optim=...)` for the same optimizer.
        state: what its state holds per parameter, in a few words.
        build: `(params, lr) -> optimizer`, for a custom loop.
    """

    name: str
    trainer_optim: str
    state: str
    build: Callable[[Any, float], torch.optim.Optimizer]


OPTIMIZERS: Dict[str, OptimizerChoice] = {
    choice.name: choice
    for choice in (
        OptimizerChoice("adamw", "adamw_torch", "two fp32 moments per parameter", _adamw),
        OptimizerChoice("adafactor", "adafactor", "factored fp32 second moment, no first moment", _adafactor),
        OptimizerChoice("adamw_8bit", "adamw_bnb_8bit", "two moments quantized to 8 bits", _adamw_8bit),
    )
}


def parse_optimizer_names(text: str) -> List[str]:
    """`"adamw,adafactor"` -> `["adamw", "adafactor"]`; an unknown name is an argparse error."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in OPTIMIZERS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"{text!r}: choose a comma-separated list from {', '.join(OPTIMIZERS)}")
    return names


# -- command line ----------------------------------------------------------------------------------


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a whole number of at least 1")
    return value


def example_parser(
    doc: str, default_model: str, default_output_dir: str, default_epochs: int, default_learning_rate: float
) -> argparse.ArgumentParser:
    """A parser with the options every example takes, and the defaults that suit its default model.

    Args:
        doc: the script's docstring, shown as it is written by `--help`.
    """
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--model", default=default_model,
        help=f"a local folder, '{TINY_MODEL}', 'distilbert-base-cased' or a hub name (default: {default_model}); "
             "a folder with only a config.json, or a shipped config while offline, gets random weights "
             "and a tokenizer built from the training texts",
    )
    parser.add_argument("--output-dir", default=default_output_dir,
                        help=f"where results go (default: {default_output_dir})")
    parser.add_argument("--num-epochs", type=positive_int, default=default_epochs,
                        help=f"epochs over the training set (default: {default_epochs})")
    parser.add_argument("--max-steps", type=positive_int, default=None,
                        help="stop after this many optimizer steps, overriding --num-epochs")
    parser.add_argument("--batch-size", type=positive_int, default=16, help="examples per step (default: 16)")
    parser.add_argument("--learning-rate", type=float, default=default_learning_rate,
                        help=f"peak learning rate, decayed linearly to 0 (default: {default_learning_rate:g})")
    parser.add_argument("--logging-steps", type=positive_int, default=5,
                        help="log every this many optimizer steps (default: 5)")
    parser.add_argument("--train-samples", type=positive_int, default=None,
                        help="use only the first N training reviews")
    parser.add_argument("--eval-samples", type=positive_int, default=None,
                        help="use only the first N validation reviews")
    parser.add_argument("--seed", type=int, default=0, help="seeds data order and random weights (default: 0)")
    return parser


def add_optimizer_argument(parser: argparse.ArgumentParser) -> None:
    """`--optim`, for the scripts that train with one optimizer."""
    parser.add_argument("--optim", choices=list(OPTIMIZERS), default="adamw",
                        help="adamw: torch AdamW; adafactor: transformers Adafactor; "
                             "adamw_8bit: bitsandbytes 8-bit AdamW (default: adamw)")
