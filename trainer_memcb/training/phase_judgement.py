"""Which phase held the most, training or evaluation, and why: judged from the logged figures.

The training step holds the model states (parameters, gradients, optimizer state, master weights:
`model_states_bytes`) and, at its peak, the activations (`activations_peak_bytes`). Evaluation
holds the model states without the gradients (the Trainer has zeroed them, to None, before it
evaluates), its forward's peak (`forward_peak_bytes`) and what its containers gather
(`concat_peak_bytes`, their most while a concatenation holds old, new and result). Each phase's
figure is that sum of what was measured; a part that was not measured counts 0, and is named.
The largest evaluation of the run is the one judged. When evaluation holds the most and its
containers outweigh its forward, the cause is named: the logits (or whatever the model returns)
gathered batch after batch on the device.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Dict, Iterable, List, Mapping, Optional

from trainer_memcb.training.figures import (
    ACTIVATIONS_PEAK_BYTES,
    CONCAT_PEAK_BYTES,
    CONTAINERS_DEVICE_BYTES,
    EVALUATION_KEYS,
    FORWARD_PEAK_BYTES,
    MODEL_GRADS_BYTES,
    MODEL_STATES_BYTES,
)
from trainer_memcb.utils.units import format_bytes

__all__ = ["PhaseJudgement", "judge_phases", "largest_evaluation"]


def _count(value: Any) -> Optional[int]:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


@dataclass(frozen=True)
class PhaseJudgement:
    """Attributes:
        training_bytes, evaluation_bytes: each phase's figure (the module's docstring).
        phase: `"training"` or `"evaluation"`, whichever held the most (training on a tie).
        cause: `"evaluation containers"`, `"evaluation forward"`, or None (training held the most).
        parts: the figures each sum was made of; missing: the parts not measured.
    """

    training_bytes: int
    evaluation_bytes: int
    phase: str
    cause: Optional[str]
    parts: Dict[str, int] = field(default_factory=dict)
    missing: List[str] = field(default_factory=list)

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)

    def text(self) -> str:
        """One line for people.

        Examples:
            >>> judge_phases({"model_states_bytes": 100, "model_grads_bytes": 20, "activations_peak_bytes": 30},
            ...              {"forward_peak_bytes": 10, "concat_peak_bytes": 90}).text()
            'Evaluation held the most: 180 B against training step 130 B; the cause: the logits its containers gathered on the device (90 B at a concatenation), more than its forward (10 B): eval_accumulation_steps or preprocess_logits_for_metrics would shrink them'
        """
        held = f"{format_bytes(self.evaluation_bytes)} against training step {format_bytes(self.training_bytes)}"
        if self.phase == "training":
            return (f"The training step held the most: {format_bytes(self.training_bytes)} against evaluation "
                    f"{format_bytes(self.evaluation_bytes)}")
        if self.cause == "evaluation containers":
            return (f"Evaluation held the most: {held}; the cause: the logits its containers gathered on the device "
                    f"({format_bytes(self.parts.get(CONCAT_PEAK_BYTES, 0))} at a concatenation), more than its "
                    f"forward ({format_bytes(self.parts.get(FORWARD_PEAK_BYTES, 0))}): eval_accumulation_steps or "
                    "preprocess_logits_for_metrics would shrink them")
        return (f"Evaluation held the most: {held}; the cause: its forward "
                f"({format_bytes(self.parts.get(FORWARD_PEAK_BYTES, 0))}): a smaller per_device_eval_batch_size "
                "would lower it")


def largest_evaluation(entries: Iterable[Mapping[str, Any]]) -> Dict[str, int]:
    """The evaluation figures (unprefixed) of the evaluation entry that held the most, from log
    entries with any evaluation prefix (`eval_concat_peak_bytes`, `eval_val_concat_peak_bytes`, ...).

    Examples:
        >>> largest_evaluation([{"eval_concat_peak_bytes": 5}, {"eval_concat_peak_bytes": 9, "eval_loss": 1.0,
        ...                     "eval_host_concat_peak_bytes": 4}])
        {'concat_peak_bytes': 9, 'host_concat_peak_bytes': 4}
    """
    best: Dict[str, int] = {}
    for entry in entries:
        figures = {}
        for logged, value in entry.items():
            key = _evaluation_key(logged)
            if key is not None and _count(value) is not None:
                figures[key] = value
        if figures and _held(figures) > _held(best):
            best = figures
    return best


def _evaluation_key(logged: Any) -> Optional[str]:
    """The evaluation key a logged name carries, with or without a prefix; the longest that fits
    (`eval_host_concat_peak_bytes` is `host_concat_peak_bytes`, not `concat_peak_bytes`)."""
    if not isinstance(logged, str):
        return None
    fitting = [key for key in EVALUATION_KEYS if logged == key or logged.endswith("_" + key)]
    return max(fitting, key=len) if fitting else None


def _held(figures: Mapping[str, int]) -> int:
    containers = figures.get(CONCAT_PEAK_BYTES, figures.get(CONTAINERS_DEVICE_BYTES, 0))
    return containers + figures.get(FORWARD_PEAK_BYTES, 0)


def judge_phases(training: Mapping[str, Any], evaluation: Mapping[str, Any]) -> Optional[PhaseJudgement]:
    """Which phase held the most; None without evaluation figures or training's model states.

    Args:
        training: unprefixed training figures (the last training entry's, or the summary's final ones).
        evaluation: unprefixed evaluation figures (`largest_evaluation`).
    """
    states = _count(training.get(MODEL_STATES_BYTES))
    if states is None or not any(_count(evaluation.get(key)) is not None for key in EVALUATION_KEYS):
        return None
    missing = [key for key in (MODEL_GRADS_BYTES, ACTIVATIONS_PEAK_BYTES) if _count(training.get(key)) is None]
    grads = _count(training.get(MODEL_GRADS_BYTES)) or 0
    activations = _count(training.get(ACTIVATIONS_PEAK_BYTES)) or 0
    forward = _count(evaluation.get(FORWARD_PEAK_BYTES))
    containers = _count(evaluation.get(CONCAT_PEAK_BYTES))
    if containers is None:
        containers = _count(evaluation.get(CONTAINERS_DEVICE_BYTES))
        if containers is None:
            missing.append(CONCAT_PEAK_BYTES)
    if forward is None:
        missing.append(FORWARD_PEAK_BYTES)
    training_bytes = states + activations
    evaluation_bytes = states - grads + (forward or 0) + (containers or 0)
    parts = {MODEL_STATES_BYTES: states, MODEL_GRADS_BYTES: grads, ACTIVATIONS_PEAK_BYTES: activations,
             FORWARD_PEAK_BYTES: forward or 0, CONCAT_PEAK_BYTES: containers or 0}
    if evaluation_bytes > training_bytes:
        cause = "evaluation containers" if (containers or 0) >= (forward or 0) else "evaluation forward"
        return PhaseJudgement(training_bytes, evaluation_bytes, "evaluation", cause, parts, missing)
    return PhaseJudgement(training_bytes, evaluation_bytes, "training", None, parts, missing)
