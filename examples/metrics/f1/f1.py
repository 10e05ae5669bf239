"""F1 as an `evaluate` module that loads from this folder, with no network.

`evaluate.load("examples/metrics/f1")` finds this file by the folder's name. The score comes from
scikit-learn's `f1_score`: 2 * precision * recall / (precision + recall) of the positive label
(`average="binary"`, `pos_label=1` by default).
"""

import datasets
import evaluate
from sklearn.metrics import f1_score

_DESCRIPTION = "F1: the harmonic mean of precision and recall, 2 * TP / (2 * TP + FP + FN)."

_KWARGS_DESCRIPTION = """
Args:
    predictions (`list` of `int`): predicted labels.
    references (`list` of `int`): true labels.
    pos_label (`int`): the positive label, for `average="binary"`. Defaults to 1.
    average (`str`): `"binary"`, `"micro"`, `"macro"` or `"weighted"`. Defaults to `"binary"`.
Returns:
    f1 (`float`): between 0.0 and 1.0.
Example:
    >>> f1 = evaluate.load("examples/metrics/f1")
    >>> f1.compute(predictions=[0, 1, 1, 0], references=[0, 1, 0, 0])
    {'f1': 0.6666666666666666}
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class F1(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="",
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features(
                {"predictions": datasets.Value("int32"), "references": datasets.Value("int32")}
            ),
            reference_urls=["https://scikit-learn.org/stable/modules/generated/sklearn.metrics.f1_score.html"],
        )

    def _compute(self, predictions, references, pos_label=1, average="binary"):
        return {"f1": float(f1_score(references, predictions, pos_label=pos_label, average=average))}
