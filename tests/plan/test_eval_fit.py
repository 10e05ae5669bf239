"""The evaluation plan's proposals: smaller eval batches and `eval_accumulation_steps`, each planned
by `plan_eval_memory`, ranked fewest batches first among those that fit."""

from __future__ import annotations

import pytest
import transformers
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from trainer_memcb.plan.answers.eval_fit import search_eval_fits
from trainer_memcb.plan.answers.eval_memory import EvalSettings, plan_eval_memory

# The exact figures here were counted on torch 2.13 and transformers 5. On transformers 4.57 the
# models hold 16 to 32 bytes of buffers more or less (rotary's original_inv_freq is an attribute
# there) and torch 2.6's fake process group cannot run FSDP2's all-gather, so the oldest pass does
# not hold these figures (tests/plan/test_engines.py computes that difference for its own).
pytestmark = pytest.mark.skipif(
    tuple(int(part) for part in torch.__version__.split(".")[:2]) < (2, 13)
    or int(transformers.__version__.split(".")[0]) < 5,
    reason="figures counted on torch 2.13 and transformers 5; the oldest releases differ by model buffers")


USABLE = 3 * 2**20


def _build():
    with torch.device("meta"):
        return LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=4, vocab_size=256,
                                            max_position_embeddings=64))


def _plan(settings):
    return plan_eval_memory(_build, settings, device_memory=USABLE)


@pytest.fixture(scope="module")
def search():
    # use_cache=False: transformers 5's Trainer evaluates without a cache (TrainingArguments.use_cache).
    return search_eval_fits(_plan, EvalSettings(batch_size=16, samples=64, seq_len=64, use_cache=False))


def test_the_own_evaluation_misses_and_smaller_batches_moved_each_batch_fit(search):
    # 64 samples of fp32 logits (65,536 bytes each) kept on the device until the end: 11,503,680 at the peak.
    assert search.fits_as_is is False and search.own.peak_bytes == 11_503_680
    first = search.best
    assert first.training_args == {"per_device_eval_batch_size": 8, "eval_accumulation_steps": 1}
    assert (first.peak_bytes, first.margin_bytes, first.micro_batches) == (2_307_936, USABLE - 2_307_936, 8)
    assert [c.label for c in search.candidates if c.fits] == [
        f"eval batch {b}, eval_accumulation_steps 1" for b in (8, 4, 2, 1)]


def test_moving_the_containers_every_batch_alone_halves_the_peak_but_misses(search):
    moved = next(c for c in search.candidates if c.changes == {"eval_accumulation_steps": 1})
    assert moved.training_args == {"per_device_eval_batch_size": 16, "eval_accumulation_steps": 1}
    assert (moved.peak_bytes, moved.fits) == (4_147_072, False)
    # Each proposal is the plan of its settings, nothing else.
    assert moved.peak_bytes == _plan(EvalSettings(batch_size=16, samples=64, seq_len=64, use_cache=False,
                                                  accumulation_steps=1)).device_peak_bytes


def test_a_bad_max_candidates_is_refused():
    with pytest.raises(ValueError, match="max_candidates=0"):
        search_eval_fits(_plan, EvalSettings(batch_size=2, samples=4, seq_len=8), max_candidates=0)
