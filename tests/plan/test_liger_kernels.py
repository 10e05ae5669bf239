"""`use_liger_kernel=True` planned without liger-kernel (plan/step/liger_kernels.py): the stand-ins'
values and gradients against transformers' own Llama on real tensors, what each saves and allocates
against liger-kernel 0.8.5's sources (ops/fused_linear_cross_entropy.py, ops/rms_norm.py,
ops/swiglu.py, ops/rope.py: shapes and dtypes read there, bytes derived here), and a step planned
with Liger against one without.

Not run here: liger-kernel itself (Triton kernels, GPU only); each kernel is stood in for by what it
does to memory (it writes into tensors the Function allocated), and on real CPU tensors by the same
math in torch, so values are compared with a tolerance, bytes exactly."""

from __future__ import annotations

import copy

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from trainer_memcb.plan.step.live_storages import LiveStorages
from trainer_memcb.plan.step.liger_kernels import (CrossEntropyFunction, FusedLinearCrossEntropyFunction,
                                                   RMSNormFunction, RopeFunction, SiLUMulFunction, chunk_rule,
                                                   liger_kernels_as_cuda)
from trainer_memcb.state.saved_tensors import storages_of

transformers = pytest.importorskip("transformers")
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

FP32, BF16 = torch.float32, torch.bfloat16


def _tiny_llama() -> LlamaForCausalLM:
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=256)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.config._attn_implementation = "sdpa"
    return model


def test_loss_and_gradients_equal_transformers_on_real_tensors():
    reference = _tiny_llama()
    patched = copy.deepcopy(reference)
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    labels[0, :5] = -100  # ignored positions: no loss, no gradient
    items = torch.tensor(float((labels[:, 1:] != -100).sum()))
    loss = reference(input_ids=ids, labels=labels, num_items_in_batch=items).loss
    loss.backward()
    with liger_kernels_as_cuda(patched, None, (8, 0), 108) as run:
        ours = patched(input_ids=ids, labels=labels, num_items_in_batch=items)
        ours.loss.backward()
    assert ours.logits is None  # lce_forward makes no logits in training
    torch.testing.assert_close(ours.loss, loss)
    for (name, want), got in zip(reference.named_parameters(), patched.parameters()):
        torch.testing.assert_close(got.grad, want.grad, atol=1e-6, rtol=1e-4, msg=name)
    # One fused loss, 2 layers x 2 norms + the final one, 2 MLPs, 2 rotary embeddings.
    assert run.calls == {"fused_linear_cross_entropy": 1, "rms_norm": 5, "swiglu": 2, "rope": 2}
    # BT 48, H 64, V 256: inc_factor cdiv(256, 64) = 4, chunk next_power_of_2(cdiv(48, 4)) = 16, 3 chunks
    assert run.chunks == [(48, 16, 3)]
    # Everything undone on exit: the instance's forwards and the modeling module's rotary function.
    from transformers.models.llama import modeling_llama

    assert "forward" not in patched.__dict__ and "forward" not in patched.model.norm.__dict__
    assert modeling_llama.apply_rotary_pos_emb.__module__ == modeling_llama.__name__


def test_the_unfused_cross_entropy_equals_transformers_loss_on_real_tensors():
    import torch.nn.functional as F

    reference = _tiny_llama()
    patched = copy.deepcopy(reference)
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    items = torch.tensor(float(2 * 23))
    reference(input_ids=ids, labels=ids, num_items_in_batch=items).loss.backward()
    kernels = {"cross_entropy": True, "fused_linear_cross_entropy": False}
    with liger_kernels_as_cuda(patched, kernels, (8, 0), 108) as run:
        assert F.cross_entropy.__name__ == "liger_cross_entropy"  # torch's own, as liger-kernel patches it
        patched(input_ids=ids, labels=ids, num_items_in_batch=items).loss.backward()
    assert F.cross_entropy.__name__ == "cross_entropy"
    for (name, want), got in zip(reference.named_parameters(), patched.parameters()):
        torch.testing.assert_close(got.grad, want.grad, atol=1e-6, rtol=1e-4, msg=name)
    assert run.calls == {"cross_entropy": 1, "rms_norm": 5, "swiglu": 2, "rope": 2}


@pytest.mark.parametrize("family", ["mistral", "qwen2", "qwen3"])
def test_the_other_planned_families_are_patched_alike(family):
    # apply_liger_kernel_to_mistral / _qwen2 / _qwen3: the same kernels; Qwen3's q_norm and k_norm too.
    from transformers import AutoModelForCausalLM, MistralConfig, Qwen2Config, Qwen3Config

    config = {"mistral": MistralConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}[family](
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=256, head_dim=16)
    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    patched = copy.deepcopy(reference)
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    reference(input_ids=ids, labels=ids).loss.backward()
    with liger_kernels_as_cuda(patched, None, (8, 0), 108) as run:
        patched(input_ids=ids, labels=ids).loss.backward()  # no num_items_in_batch: reduction "mean"
    for (name, want), got in zip(reference.named_parameters(), patched.parameters()):
        torch.testing.assert_close(got.grad, want.grad, atol=1e-6, rtol=1e-4, msg=name)
    norms = 5 + (2 * 2 if family == "qwen3" else 0)
    assert run.calls == {"fused_linear_cross_entropy": 1, "rms_norm": norms, "swiglu": 2, "rope": 2}


def test_chunk_rule_as_the_source():
    # The source's own example: "BT = 4096*4, V = 32000, H = 4096 ==> inc_factor = 8, chunk_size = 2048"
    assert chunk_rule(4096 * 4, 4096, 32000) == (2048, 8)
    # Llama 3's vocabulary at 8 x 1024: inc_factor cdiv(128256, 4096) = 32, cdiv(8192, 32) = 256
    assert chunk_rule(8192, 4096, 128256) == (256, 32)
    # `min(chunk_size, BT)`: never more rows than BT (next_power_of_2(3) = 4)
    assert chunk_rule(3, 64, 64) == (3, 1)


def _births(run, *alive) -> tuple:
    """The sizes of the storages `run()` allocates, in order, its peak over what was `alive` before
    (the tensors, and those autograd saved for their `grad_fn`), and what it returned."""
    tracker = LiveStorages(keep_timeline=True)
    for tensor in alive:
        tracker.add(tensor)
        for saved in getattr(getattr(tensor, "grad_fn", None), "saved_tensors", None) or ():
            if saved is not None:
                tracker.add(saved)
    before, start = tracker.alive_bytes, len(tracker.events)
    tracker.peak_bytes = before
    with tracker:
        kept = run()
    born = [tracker.sizes[event] for event in tracker.events[start:] if event >= 0]
    return born, tracker.peak_bytes - before, kept


def test_fused_linear_cross_entropy_fp32_allocates_and_saves_as_the_source():
    bt, hidden, vocab = 96, 64, 512  # inc_factor 8, chunk 16, 6 chunks
    with FakeTensorMode():
        x = torch.empty(bt, hidden, requires_grad=True)
        weight = torch.empty(vocab, hidden, requires_grad=True)
        target = torch.zeros(bt, dtype=torch.int64)
        born, peak, loss = _births(lambda: FusedLinearCrossEntropyFunction.apply(x, weight, target, -100, "sum"),
                                   x, weight, target)
        grad_input, grad_weight = loss.grad_fn.saved_tensors
    # grad_input = zeros_like(_input); grad_weight = zeros_like(weight); loss_1d fp32 [BT];
    # target != ignore_index, bool [BT]; its .sum() (read by .item()), int64; logits_storage [chunk, V] in
    # _input's dtype (`_can_use_mm_out`: CUDA, same dtypes, no autocast); per chunk, the legacy weight
    # path (fp32 grad_logits): torch.mm(grad_logits.t(), _input_chunk) [V, H], `.float()` a no-op; the loss's sum.
    expected = [bt * hidden * 4, vocab * hidden * 4, bt * 4, bt, 8, 16 * vocab * 4] + [vocab * hidden * 4] * 6 + [4]
    assert born == expected
    assert peak == sum(expected[:6]) + vocab * hidden * 4 == 319_976
    # ctx.save_for_backward(grad_input.detach(), grad_weight.detach())
    assert (grad_input.shape, grad_input.dtype) == ((bt, hidden), FP32)
    assert (grad_weight.shape, grad_weight.dtype) == ((vocab, hidden), FP32)


def test_fused_linear_cross_entropy_bf16_on_ampere_adds_in_place():
    bt, hidden, vocab = 96, 64, 512
    with FakeTensorMode(), liger_kernels_as_state((8, 0)):
        x = torch.empty(bt, hidden, dtype=BF16, requires_grad=True)
        weight = torch.empty(vocab, hidden, dtype=BF16, requires_grad=True)
        target = torch.zeros(bt, dtype=torch.int64)
        born, peak, loss = _births(lambda: FusedLinearCrossEntropyFunction.apply(x, weight, target, -100, "mean"),
                                   x, weight, target)
        # The backward scales the saved gradients in place; `torch.tensor(1.0)` for torch.equal: 4 bytes.
        grad = torch.ones((), dtype=FP32)
        saved = [key for key, _, _ in storages_of(list(loss.grad_fn.saved_tensors))]
        backward_born, _, grads = _births(lambda: torch.autograd.grad(loss, (x, weight), grad), x, weight, loss, grad)
    # bf16 grad_logits and grad_weight on sm80: `torch.addmm(grad_weight, ..., out=grad_weight)`, no temporary;
    # grad_input's rows by torch.mm(..., out=grad_input[rows]).
    assert born == [bt * hidden * 2, vocab * hidden * 2, bt * 4, bt, 8, 16 * vocab * 2, 4]
    assert backward_born == [4]
    assert [key for key, _, _ in storages_of(list(grads))] == saved  # the saved gradients are returned


def liger_kernels_as_state(capability, sm_count=108):
    """The kernels' GPU for a bare Function call (what `liger_kernels_as_cuda` sets for a trace)."""
    import contextlib

    from trainer_memcb.plan.step import liger_kernels

    @contextlib.contextmanager
    def state():
        saved = dict(liger_kernels._STATE)
        liger_kernels._STATE.update(compute_capability=capability, sm_count=sm_count)
        try:
            yield
        finally:
            liger_kernels._STATE.update(saved)

    return state()


def test_fused_linear_cross_entropy_before_ampere_takes_the_legacy_path():
    bt, hidden, vocab = 96, 64, 512
    with FakeTensorMode(), liger_kernels_as_state((7, 5)):
        x = torch.empty(bt, hidden, dtype=BF16, requires_grad=True)
        weight = torch.empty(vocab, hidden, dtype=BF16, requires_grad=True)
        target = torch.zeros(bt, dtype=torch.int64)
        born, _, _ = _births(lambda: FusedLinearCrossEntropyFunction.apply(x, weight, target, -100, "mean"),
                             x, weight, target)
    # `grad_weight += torch.mm(grad_logits_chunk.t(), _input_chunk).float()`: bf16 [V, H], then its fp32 copy.
    per_chunk = [vocab * hidden * 2, vocab * hidden * 4]
    assert born == [bt * hidden * 2, vocab * hidden * 2, bt * 4, bt, 8, 16 * vocab * 2] + per_chunk * 6 + [4]


def test_fused_linear_cross_entropy_under_bf16_autocast_over_fp32_weights():
    from trainer_memcb.plan.step.cuda_autocast import autocast_as, cuda_autocast_policy

    bt, hidden, vocab = 96, 64, 512
    with FakeTensorMode(), liger_kernels_as_state((8, 0)), autocast_as(cuda_autocast_policy()):
        x = torch.empty(bt, hidden, requires_grad=True)  # the fp32 residual stream's final norm
        weight = torch.nn.Parameter(torch.empty(vocab, hidden))
        target = torch.zeros(bt, dtype=torch.int64)
        with torch.autocast("cpu", dtype=BF16):  # as the trace runs CUDA's autocast
            born, _, loss = _births(lambda: FusedLinearCrossEntropyFunction.apply(x, weight, target, -100, "mean"),
                                    x, weight, target)
        saved = [(tuple(t.shape), t.dtype) for t in loss.grad_fn.saved_tensors]
    # `_can_use_mm_out` is False (fp32 input under a bf16 autocast): no logits_storage. Per chunk, autocast's
    # matmul casts `_input_chunk` and `weight.t()` (a view: not in autocast's cache) to bf16 and makes bf16
    # logits [16, V]; `grad_logits_chunk @ weight` casts the weight once (a leaf: cached) and makes bf16 rows
    # copied into the fp32 grad_input; the weight's gradient (fp32 accumulator, bf16 grad_logits, sm80, torch
    # >= 2.8: addmm with out_dtype) casts `_input_chunk` to bf16 again; before 2.8, the legacy path's
    # `torch.mm(grad_logits.t(), _input_chunk)` (autocast: the chunk cast to bf16, a bf16 [V, H]) and its `.float()`.
    from helpers import installed_version

    weight_path = ([16 * hidden * 2] if installed_version("torch") >= (2, 8)
                   else [16 * hidden * 2, vocab * hidden * 2, vocab * hidden * 4])
    chunk = [16 * hidden * 2, hidden * vocab * 2, 16 * vocab * 2]
    first = chunk + [vocab * hidden * 2, 16 * hidden * 2] + weight_path
    rest = chunk + [16 * hidden * 2] + weight_path
    assert born == [bt * hidden * 4, vocab * hidden * 4, bt * 4, bt, 8] + first + rest * 5 + [4]
    assert saved == [((bt, hidden), FP32), ((vocab, hidden), FP32)]


def test_cross_entropy_writes_the_gradient_over_its_input_and_saves_it():
    bt, vocab = 96, 512
    with FakeTensorMode():
        logits = torch.empty(bt, vocab, requires_grad=True)  # transformers' fp32 upcast, [BT, V]
        target = torch.zeros(bt, dtype=torch.int64)
        born, _, loss = _births(lambda: CrossEntropyFunction.apply(logits, target, -100, "sum"), logits, target)
        [saved] = loss.grad_fn.saved_tensors
        same = [key for key, _, _ in storages_of([saved, logits])]
        grad = torch.full((), 0.5)
        backward_born, _, (grad_logits,) = _births(lambda: torch.autograd.grad(loss, (logits,), grad), logits, loss,
                                                   grad)
        returned = [key for key, _, _ in storages_of([grad_logits])]
    # loss_1d [BT] in the input's dtype; the target mask (bool) and its sum (int64); the bounds checks:
    # target * mask (int64 [BT]) and its max, `< V` (a bool), again for the min and `>= 0`; the loss's sum.
    assert born == [bt * 4, bt, 8, bt * 8, 8, 1, bt * 8, 8, 1, 4]
    assert same[0] == same[1]  # ctx.save_for_backward(_input.detach()): the gradient over the logits
    # The backward: torch.equal's 4-byte operand; element_mul_kernel scales the saved tensor in place.
    assert backward_born == [4] and returned == same[:1]


def test_rms_norm_saves_x_and_fp32_rstd_and_its_backward_allocates_dw_per_sm():
    with FakeTensorMode(), liger_kernels_as_state((9, 0), sm_count=132):  # an H100 SXM's SMs
        x = torch.empty(2, 8, 64, dtype=BF16, requires_grad=True)
        w = torch.empty(64, dtype=BF16, requires_grad=True)
        born, _, y = _births(lambda: RMSNormFunction.apply(x, w, 1e-6), x, w)
        saved_x, saved_w, rstd = y.grad_fn.saved_tensors
        dy = torch.empty(2, 8, 64, dtype=BF16)
        backward_born, backward_peak, (dx, dw) = _births(lambda: torch.autograd.grad(y, (x, w), dy), x, w, y, dy)
        same = [key for key, _, _ in storages_of([dx, dy, saved_x, x])]
    # Y = empty((rows, cols), X.dtype); RSTD = empty(rows, float32) in the "llama" casting mode
    assert born == [16 * 64 * 2, 16 * 4]
    assert (y.shape, rstd.shape, rstd.dtype) == ((2, 8, 64), (16,), FP32)
    assert same[0] == same[1] and same[2] == same[3]  # dX written over dY; X saved as given
    # _dW = empty((sm_count, n_cols), float32); dW = _dW.sum(dim=0).to(W.dtype)
    assert backward_born == [132 * 64 * 4, 64 * 4, 64 * 2]
    assert backward_peak == 132 * 64 * 4 + 64 * 4 + 64 * 2 == 34_176
    assert dw.dtype == BF16 and saved_w.shape == (64,)


def test_swiglu_saves_a_and_b_and_returns_them_as_their_gradients():
    with FakeTensorMode():
        a = torch.empty(2, 8, 128, dtype=BF16, requires_grad=True)
        b = torch.empty(2, 8, 128, dtype=BF16, requires_grad=True)
        born, _, c = _births(lambda: SiLUMulFunction.apply(a, b), a, b)
        saved = [key for key, _, _ in storages_of(list(c.grad_fn.saved_tensors))]
        dc = torch.empty(2, 8, 128, dtype=BF16)
        backward_born, _, grads = _births(lambda: torch.autograd.grad(c, (a, b), dc), a, b, c, dc)
        keys = [key for key, _, _ in storages_of([a, b])]
    assert born == [2 * 8 * 128 * 2]  # c = empty_like(a)
    assert saved == keys  # ctx.save_for_backward(a, b)
    assert backward_born == [] and [key for key, _, _ in storages_of(list(grads))] == keys


def test_rope_rotates_in_place_and_saves_cos_and_sin():
    batch, seq, heads, kv_heads, dim = 2, 8, 4, 2, 16
    with FakeTensorMode():
        # as LlamaAttention makes them: the projections' [B, T, H, D] outputs, transposed to [B, H, T, D]
        q = torch.empty(batch, seq, heads, dim, requires_grad=True).transpose(1, 2)
        k = torch.empty(batch, seq, kv_heads, dim, requires_grad=True).transpose(1, 2)
        cos, sin = torch.empty(batch, seq, dim), torch.empty(batch, seq, dim)
        born, _, (q_out, k_out) = _births(lambda: RopeFunction.apply(q, k, cos, sin), q, k, cos, sin)
        saved = [key for key, _, _ in storages_of(list(q_out.grad_fn.saved_tensors))]
        same = [key for key, _, _ in storages_of([q_out, q, k_out, k, cos, sin])]
        # gradients laid out [B, H, T, D]: `dq.transpose(1, 2).contiguous()` copies each
        dq, dk = torch.empty(batch, heads, seq, dim), torch.empty(batch, kv_heads, seq, dim)
        backward_born, _, _ = _births(lambda: torch.autograd.grad((q_out, k_out), (q, k), (dq, dk)), q, k, q_out, k_out,
                                     dq, dk)
    assert born == []
    assert same[0] == same[1] and same[2] == same[3] and saved == same[4:]
    assert backward_born == [batch * seq * heads * dim * 4, batch * seq * kv_heads * dim * 4]


# A mid-size Llama, where the logits (B x T x V) are the step's largest tensors.
MID = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
           vocab_size=32000)
B, T, HIDDEN, VOCAB = 4, 512, 256, 32000


def _mid_plan(**flags):
    from trainer_memcb.plan.answers.step_memory import plan_step_memory

    def build():
        with torch.device("meta"):
            return LlamaForCausalLM(LlamaConfig(**MID))

    plan, _ = plan_step_memory(build, batch_size=B, seq_len=T, optimizer="adamw_torch", device_type="cuda",
                               model_states=False, **flags)
    return plan


def _transformers_4_figures():
    """What the same step holds on transformers 4.x beside 5's (`helpers`): its rotary buffers, and the
    KV cache its Trainer leaves on (config.use_cache), alive in the forward: k and v of each of the
    2 layers, [B, 2 kv heads, T, 64] fp32."""
    from helpers import TRANSFORMERS_4, rotary_buffers_beyond_transformers_5s

    with torch.device("meta"):
        buffers = rotary_buffers_beyond_transformers_5s(LlamaForCausalLM(LlamaConfig(**MID)))
    return buffers, (2 * 2 * B * 2 * T * 64 * 4 if TRANSFORMERS_4 else 0)


def _peak_sizes(plan):
    timeline = plan.timeline
    at = timeline.forward_backward
    return sorted((timeline.sizes[key] for key in at.storages), reverse=True)


def test_the_logits_peak_is_gone_with_the_fused_linear_cross_entropy():
    without, with_liger = _mid_plan(), _mid_plan(use_liger_kernel=True)
    buffers, cache = _transformers_4_figures()
    logits = B * T * VOCAB * 4  # fp32 [B, T, V]: 262,144,000 bytes
    # Without: the backward's peak holds the logits twice (transformers' loss: the logits and their gradient).
    assert sorted(_peak_sizes(without)[:2]) == [logits, logits]
    assert (without.step.peak_bytes - buffers, without.step.peak_phase) == (1_112_907_104, "backward")
    # With Liger: no storage of the step holds the logits; the largest made in it is the legacy weight path's
    # [V, H] fp32 product (fp32 grad_logits), 32,768,000 bytes.
    made = [size for serial, size in with_liger.timeline.sizes.items()
            if serial not in with_liger.timeline.groups["parameters"]
            and serial not in with_liger.timeline.groups["optimizer_state"]]
    assert max(made) == VOCAB * HIDDEN * 4 == 32_768_000
    assert (with_liger.step.peak_bytes - buffers - cache, with_liger.step.peak_phase) == (379_372_928, "forward")
    # The forward's peak is inside the fused loss's chunk loop: BT 2048 rows, inc_factor cdiv(32000, 256) = 125,
    # chunk next_power_of_2(cdiv(2048, 125)) = 32. What is alive then besides the model states, the batch and
    # the activations, each from the sources' shapes:
    bt, chunk = B * T, 32
    other = (chunk * VOCAB * 4            # logits_storage [chunk, V] fp32 (mm out=)
             + VOCAB * HIDDEN * 4         # torch.mm(grad_logits.t(), _input_chunk): the legacy path's [V, H]
             + bt * 4 + bt + 8            # loss_1d fp32, target_mask bool, its sum (int64)
             + bt * HIDDEN * 4            # grad_input = zeros_like(_input)
             + B * (T + 1) * 8 + bt * 8   # LigerForCausalLMLoss: labels padded by one, shift_labels
             + bt * HIDDEN * 4            # the final RMSNorm's output, saved by nothing (the kernel saves gradients)
             + 4                          # num_items_in_batch, the Trainer's fp32 count
             + cache)                     # transformers 4.x: the KV cache
    assert with_liger.step.peak_parts["other"] == other and other - cache == 41_101_356
    assert with_liger.step.peak_parts["gradients"] == VOCAB * HIDDEN * 4  # grad_weight, lm_head's gradient to be
    assert any("fused_linear_cross_entropy (1 calls)" in note and "2048 rows in 64 chunks of 32" in note
               for note in with_liger.step.notes)


def test_each_kernel_can_be_turned_off_by_the_config():
    plan = _mid_plan(use_liger_kernel=True, liger_kernel_config={"rope": False, "swiglu": False, "rms_norm": False})
    [note] = [note for note in plan.step.notes if note.startswith("use_liger_kernel")]
    assert "fused_linear_cross_entropy (1 calls)" in note
    assert not any(kernel in note for kernel in ("rope (", "swiglu (", "rms_norm ("))
    assert ["liger_kernel_config", {"rope": False, "swiglu": False, "rms_norm": False}, "flag"] in plan.settings.used


def test_the_unfused_cross_entropy_holds_the_logits_once():
    kernels = {"cross_entropy": True, "fused_linear_cross_entropy": False, "rope": False, "rms_norm": False,
               "swiglu": False}
    plan = _mid_plan(use_liger_kernel=True, liger_kernel_config=kernels)
    logits = B * T * VOCAB * 4
    # The backward's peak: the fp32 logits once (their gradient written over them), where transformers'
    # cross-entropy holds them and their gradient (test above).
    sizes = _peak_sizes(plan)
    assert plan.step.peak_phase == "backward" and sizes[0] == logits and sizes[1] < logits
    assert any("cross_entropy (1 calls)" in note for note in plan.step.notes)
