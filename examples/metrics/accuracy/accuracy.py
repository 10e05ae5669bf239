"""Accuracy as an `evaluate` module that loads from this folder, with no network.

`evaluate.load("examples/metrics/accuracy")` finds this file by the folder's name. The score
comes from scikit-learn's `accuracy_score`: the fraction of predictions equal to the references.
"""

import datasets
import evaluate
from sklearn.metrics import accuracy_score

_DESCRIPTION = "Accuracy: the fraction of predictions that equal the references, (TP + TN) / all."

_KWARGS_DESCRIPTION = """
Args:
    predictions (`list` of `int`): predicted labels.
    references (`list` of `int`): true labels.
Returns:
    accuracy (`float`): between 0.0 and 1.0.
Example:
    >>> accuracy = evaluate.load("examples/metrics/accuracy")
    >>> accuracy.compute(predictions=[0, 1, 1, 0], references=[0, 1, 0, 0])
    {'accuracy': 0.75}
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class Accuracy(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="",
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features(
                {"predictions": datasets.Value("int32"), "references": datasets.Value("int32")}
            ),
            reference_urls=["https://scikit-learn.org/stable/modules/generated/sklearn.metrics.accuracy_score.html"],
        )

    def _compute(self, predictions, references):
        return {"accuracy": float(accuracy_score(references, predictions))}
