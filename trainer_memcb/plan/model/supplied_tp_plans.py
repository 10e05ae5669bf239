"""Tensor-parallel plans for the encoders transformers gives none, written as torchtitan writes its
own for the models it trains: Megatron's split of each block, the attention's query, key and value
projections and the MLP's first layer by columns (`colwise`: each rank computes its own heads and
its share of the MLP's width), the attention's output projection and the MLP's second layer by rows
(`rowwise`: the partial sums all-reduced), everything else (the embeddings, the norms, the pooler
and the head) left whole on every rank.

transformers 5 gives BERT, RoBERTa, XLM-RoBERTa, CamemBERT, ELECTRA and DistilBERT no
`base_model_tp_plan`, so `from_pretrained(tp_plan="auto")` refuses them; their attention splits its
heads by the projection's width (`view(*input_shape, -1, head_size)`), so the same modules sharded
by columns run, and `from_pretrained` applies a plan given whole
(`distributed_config=DistributedConfig(tp_plan=plan, tp_size=N)`, the styles its own). transformers
4 splits them by the configured number of heads, which a sharded projection does not hold: no plan
is supplied there.
"""

from __future__ import annotations

import json
from typing import Any, Dict, Optional

__all__ = ["SUPPLIED_TP_PLANS", "supplied_tp_plan", "supplied_plan_note"]

# BERT's block as transformers 5 names it (RoBERTa, XLM-RoBERTa, CamemBERT and ELECTRA copy it),
# under the base model (`bert.`, `roberta.`, ... in a model with a head).
_BERT_BLOCK = {
    "encoder.layer.*.attention.self.query": "colwise",
    "encoder.layer.*.attention.self.key": "colwise",
    "encoder.layer.*.attention.self.value": "colwise",
    "encoder.layer.*.attention.output.dense": "rowwise",
    "encoder.layer.*.intermediate.dense": "colwise",
    "encoder.layer.*.output.dense": "rowwise",
}

SUPPLIED_TP_PLANS: Dict[str, Dict[str, str]] = {
    "bert": _BERT_BLOCK,
    "roberta": _BERT_BLOCK,
    "xlm-roberta": _BERT_BLOCK,
    "camembert": _BERT_BLOCK,
    "electra": _BERT_BLOCK,
    "distilbert": {
        "transformer.layer.*.attention.q_lin": "colwise",
        "transformer.layer.*.attention.k_lin": "colwise",
        "transformer.layer.*.attention.v_lin": "colwise",
        "transformer.layer.*.attention.out_lin": "rowwise",
        "transformer.layer.*.ffn.lin1": "colwise",
        "transformer.layer.*.ffn.lin2": "rowwise",
    },
}


def _heads_split_by_width() -> bool:
    """Whether the installed transformers' encoders split their heads by the projection's width
    (transformers 5), so that a projection sharded by columns runs."""
    import transformers

    return int(transformers.__version__.split(".")[0]) >= 5


def supplied_tp_plan(model: Any) -> Optional[Dict[str, str]]:
    """The plan supplied here for `model` (module name, `*` for a layer number -> transformers'
    style name), under its base model's prefix as `from_pretrained` takes it; None when there is
    none for its kind, or the installed transformers would not run one (transformers 4).

    Examples:
        >>> from trainer_memcb.plan.model.supplied_tp_plans import SUPPLIED_TP_PLANS
        >>> {name: style for name, style in SUPPLIED_TP_PLANS["distilbert"].items() if ".ffn." in name}
        {'transformer.layer.*.ffn.lin1': 'colwise', 'transformer.layer.*.ffn.lin2': 'rowwise'}

        DistilBERT's with a head, as `from_pretrained` takes it: under `distilbert.`.
    """
    config = getattr(model, "config", None)
    base = SUPPLIED_TP_PLANS.get(getattr(config, "model_type", None))
    if base is None or not _heads_split_by_width():
        return None
    prefix = getattr(model, "base_model_prefix", "")
    owner = getattr(model, prefix, None) if prefix else None
    return {(f"{prefix}.{name}" if owner is not None else name): style for name, style in base.items()}


def supplied_plan_note(model: Any, plan: Dict[str, str]) -> str:
    """What a plan made with the supplied rules says: whose the rules are, and how a run applies them."""
    return (f"transformers gives {type(model).__name__} no tp_plan: planned with trainer_memcb's (Megatron's split "
            "of each block, the rest whole on every rank), which a run applies as "
            f"from_pretrained(..., distributed_config=DistributedConfig(tp_plan=PLAN, tp_size=N)), PLAN = "
            f"{json.dumps(plan, separators=(',', ':'))}")
