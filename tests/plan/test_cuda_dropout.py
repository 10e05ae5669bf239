"""Dropout as CUDA runs it on the CPU trace: the bool mask saved, and what it changes in a plan."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from helpers import saved_dtypes_by_node
from trainer_memcb.plan.step.cuda_dropout import dropout_as_cuda

transformers = pytest.importorskip("transformers")
from transformers import BertConfig, BertForSequenceClassification  # noqa: E402

BATCH, SEQ, HIDDEN, HEADS, LAYERS = 2, 16, 32, 4, 2


def test_dropout_saves_a_bool_mask_and_torchs_own_path_comes_back_after() -> None:
    x = torch.rand(4, 8, requires_grad=True)
    with dropout_as_cuda():
        y = F.dropout(x * 2, 0.1, training=True)
        assert type(y.grad_fn).__name__ == "NativeDropoutBackward0"
        assert y.grad_fn._saved_result1.dtype == torch.bool and y.grad_fn._saved_result1.shape == (4, 8)
        assert F.dropout(x, 0.1, training=False) is x  # _dropout_impl returns the input itself
        assert F.dropout(x, 0.0, training=True) is x
        assert torch.equal(F.dropout(x, 1.0, training=True), torch.zeros(4, 8))
        y.sum().backward()
        assert x.grad.shape == (4, 8)
    assert type(F.dropout(x * 2, 0.1, training=True).grad_fn).__name__ == "MulBackward0"  # the noise, fp32
    with pytest.raises(ZeroDivisionError):
        with dropout_as_cuda():
            1 / 0
    assert type(F.dropout(x * 2, 0.1, training=True).grad_fn).__name__ == "MulBackward0"


def _bert() -> torch.nn.Module:
    config = BertConfig(hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                        vocab_size=100, max_position_embeddings=64, num_labels=2)
    config._attn_implementation = "eager"
    return BertForSequenceClassification(config)


def test_every_dropout_of_a_bert_saves_a_bool_mask() -> None:
    torch.manual_seed(0)
    model = _bert().train()
    ids = torch.randint(0, 100, (BATCH, SEQ))
    with dropout_as_cuda():
        loss = model(input_ids=ids, labels=torch.zeros(BATCH, dtype=torch.long)).loss
    masks = saved_dtypes_by_node(loss, keep=lambda tensor: tensor.dim() > 0)["NativeDropoutBackward0"]
    # embeddings, then per layer: attention probabilities, attention output, feed-forward output;
    # the classifier's on the pooled output.
    assert len(masks) == 1 + 3 * LAYERS + 1
    assert set(masks) == {torch.bool}


def test_a_cuda_plan_saves_three_bytes_less_per_dropped_fp32_element() -> None:
    from trainer_memcb.plan.answers.step_memory import plan_step_memory

    def build() -> torch.nn.Module:
        with torch.device("meta"):
            return _bert()

    plans = {device: plan_step_memory(build, batch_size=BATCH, seq_len=SEQ, attn_implementation="eager",
                                      model_states=False, device_type=device)[0] for device in ("cpu", "cuda")}
    tokens = BATCH * SEQ * HIDDEN
    dropped = tokens + LAYERS * (BATCH * HEADS * SEQ * SEQ + 2 * tokens) + BATCH * HIDDEN
    assert dropped == 9280
    assert plans["cpu"].step.activations_bytes - plans["cuda"].step.activations_bytes == 3 * dropped
