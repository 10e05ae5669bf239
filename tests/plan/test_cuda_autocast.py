"""CUDA autocast's casts on the CPU trace: the table against torch's dispatcher and torch's own
AutocastCUDA kernels, the saved tensors op by op, and the mechanism against CPU autocast itself."""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Tuple

import pytest
import torch
import torch.nn.functional as F

from helpers import saved_dtypes_by_node
from trainer_memcb.plan.step import cuda_autocast, trace
from trainer_memcb.plan.step.cuda_autocast import (
    CUDA_AUTOCAST_TABLE, CUDA_FP32_APPEND_DTYPE, autocast_as, autocast_policy_for, cuda_autocast_policy, registered_ops)

transformers = pytest.importorskip("transformers")
from transformers import BertConfig, BertForMaskedLM, LlamaConfig, LlamaForCausalLM  # noqa: E402

# CPU autocast's own lists (torch 2.13, aten/src/ATen/autocast_mode.cpp, TORCH_LIBRARY_IMPL(aten,
# AutocastCPU, m)): the lower_precision_fp and promote ones; every other op it registers is fp32.
CPU_LOWER_PRECISION_FP = {
    "conv1d", "conv1d.padding", "conv2d", "conv2d.padding", "conv3d", "conv3d.padding", "bmm", "mm", "linalg_vecdot",
    "baddbmm", "addmm", "_addmm_activation", "addbmm", "linear", "_convolution.deprecated", "matmul", "conv_tbc",
    "mkldnn_rnn_layer", "conv_transpose1d", "conv_transpose2d.input", "conv_transpose3d.input", "prelu",
    "scaled_dot_product_attention", "_native_multi_head_attention"}
CPU_PROMOTE = {"stack", "cat", "index_copy"}

# The lists are torch 2.13's (autocast_mode.h/.cpp); releases before 2.12 register other ops for
# AutocastCUDA (rms_norm joined the fp32 list in 2.12, and SDPA's casts differ), which the table
# does not follow: there the plan's CUDA casts are 2.13's, and these tests do not hold them.
pytestmark = pytest.mark.skipif(tuple(int(part) for part in torch.__version__.split(".")[:2]) < (2, 12),
                                reason="CUDA autocast's lists were read from torch 2.13; this torch registers others")


def cpu_autocast_table() -> Dict[str, str]:
    return {name: "lower_precision_fp" if name in CPU_LOWER_PRECISION_FP else "promote" if name in CPU_PROMOTE
            else "fp32" for name in registered_ops("AutocastCPU")}


def test_every_op_of_the_table_is_an_aten_op() -> None:
    for name in list(CUDA_AUTOCAST_TABLE) + list(CUDA_FP32_APPEND_DTYPE.values()):
        packet, _, overload = name.partition(".")
        assert isinstance(getattr(getattr(torch.ops.aten, packet), overload or "default"), torch._ops.OpOverload), name
    assert set(CUDA_AUTOCAST_TABLE.values()) == set(cuda_autocast.CAST_POLICIES) | {"banned"}
    # torch 2.13's AutocastCUDA registers 119 ops; other releases register their own set, which
    # the next test holds the table to.
    if torch.__version__.startswith("2.13."):
        assert len(CUDA_AUTOCAST_TABLE) == 119


def test_the_table_names_exactly_the_ops_torch_registers_for_autocast_cuda() -> None:
    assert sorted(CUDA_AUTOCAST_TABLE) == registered_ops("AutocastCUDA")
    assert cuda_autocast_policy() == CUDA_AUTOCAST_TABLE
    assert CPU_LOWER_PRECISION_FP | CPU_PROMOTE <= set(registered_ops("AutocastCPU"))


def test_the_policy_is_cudas_for_a_run_on_cuda_and_none_on_the_cpu() -> None:
    assert autocast_policy_for("cuda") == CUDA_AUTOCAST_TABLE
    assert autocast_policy_for("cpu") is None


# Each call: (name, function of the tensors, shapes, dtypes of the inputs). Run on fake CUDA
# tensors under torch's own AutocastCUDA kernels, and on fake CPU tensors under autocast_as.
H, F32, LOW = 8, "fp32", "low"
CALLS: List[Tuple[str, Callable[..., Any], List[Tuple[int, ...]], List[str]]] = [
    ("mm", torch.mm, [(4, H), (H, 3)], [F32, F32]),
    ("addmm", torch.addmm, [(3,), (4, H), (H, 3)], [F32, F32, F32]),
    ("linear", F.linear, [(4, H), (3, H), (3,)], [F32, F32, F32]),
    ("matmul", torch.matmul, [(2, 4, H), (H, 3)], [F32, LOW]),
    ("bmm", torch.bmm, [(2, 4, H), (2, H, 3)], [F32, F32]),
    ("baddbmm", torch.baddbmm, [(2, 4, 3), (2, 4, H), (2, H, 3)], [F32, F32, F32]),
    ("sdpa", F.scaled_dot_product_attention, [(1, 2, 4, H), (1, 2, 4, H), (1, 2, 4, H)], [F32, F32, F32]),
    ("softmax", lambda x: torch.softmax(x, -1), [(4, H)], [LOW]),
    ("softmax with a dtype", lambda x: torch.softmax(x, -1, dtype=torch.float16), [(4, H)], [LOW]),
    ("log_softmax", lambda x: F.log_softmax(x, -1), [(4, H)], [LOW]),
    ("layer_norm", lambda x, w: F.layer_norm(x, (H,), w), [(4, H), (H,)], [LOW, LOW]),
    ("rms_norm", lambda x, w: F.rms_norm(x, (H,), w), [(4, H), (H,)], [LOW, LOW]),
    ("group_norm", lambda x: F.group_norm(x, 2), [(2, 4, 3)], [LOW]),
    ("exp", torch.exp, [(4, H)], [LOW]),
    ("pow", lambda x: x.pow(2), [(4, H)], [LOW]),
    ("rsqrt", torch.rsqrt, [(4, H)], [LOW]),
    ("sum", torch.sum, [(4, H)], [LOW]),
    ("sum over a dim", lambda x: x.sum(-1), [(4, H)], [LOW]),
    ("mean (no policy)", lambda x: x.mean(-1), [(4, H)], [LOW]),
    ("cumsum", lambda x: x.cumsum(0), [(4, H)], [LOW]),
    ("norm", lambda x: torch.norm(x), [(4, H)], [LOW]),
    ("norm over a dim", lambda x: torch.norm(x, 2, dim=1), [(4, H)], [LOW]),
    ("vector_norm", torch.linalg.vector_norm, [(4, H)], [LOW]),
    ("cross_entropy", lambda x: F.cross_entropy(x, torch.zeros(4, dtype=torch.long, device=x.device)), [(4, H)], [LOW]),
    ("mse_loss", F.mse_loss, [(4, H), (4, H)], [LOW, LOW]),
    ("gelu (no policy)", F.gelu, [(4, H)], [LOW]),
    ("addcmul", torch.addcmul, [(4, H), (4, H), (4, H)], [LOW, F32, LOW]),
    ("addcmul, all low", torch.addcmul, [(4, H), (4, H), (4, H)], [LOW, LOW, LOW]),
    ("cat (CPU promotes, CUDA does not)", lambda a, b: torch.cat([a, b]), [(4, H), (4, H)], [LOW, LOW]),
    ("scatter_add", lambda x, s: x.scatter_add(0, torch.zeros(4, H, dtype=torch.long, device=x.device), s),
     [(4, H), (4, H)], [LOW, F32]),
    ("conv2d", F.conv2d, [(1, 2, 5, 5), (3, 2, 3, 3)], [F32, F32]),
]


def _run(call: Callable[..., Any], shapes: List[Tuple[int, ...]], kinds: List[str], device: str,
         low: torch.dtype) -> torch.dtype:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        tensors = [torch.empty(shape, device=device, dtype=low if kind == LOW else torch.float32)
                   for shape, kind in zip(shapes, kinds)]
        return call(*tensors).dtype


def _torch_cuda_autocast_dtype(call: Callable[..., Any], shapes: List[Tuple[int, ...]], kinds: List[str],
                               low: torch.dtype) -> torch.dtype:
    # torch.autocast("cuda") refuses without a GPU; the dispatcher's AutocastCUDA kernels run all
    # the same on fake CUDA tensors, for a forward without gradients.
    enabled, dtype = torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")
    torch.set_autocast_enabled("cuda", True)
    torch.set_autocast_dtype("cuda", low)
    try:
        return _run(call, shapes, kinds, "cuda", low)
    finally:
        torch.set_autocast_enabled("cuda", enabled)
        torch.set_autocast_dtype("cuda", dtype)
        torch.clear_autocast_cache()


@pytest.mark.parametrize("low", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name,call,shapes,kinds", CALLS, ids=[c[0] for c in CALLS])
def test_each_op_casts_as_torchs_own_cuda_autocast(name: str, call: Callable[..., Any], shapes: List[Tuple[int, ...]],
                                                     kinds: List[str], low: torch.dtype) -> None:
    expected = _torch_cuda_autocast_dtype(call, shapes, kinds, low)
    with autocast_as(cuda_autocast_policy()), torch.autocast("cpu", dtype=low):
        emulated = _run(call, shapes, kinds, "cpu", low)
    assert emulated == expected
    with torch.autocast("cpu", dtype=low):
        try:
            cpu: Any = _run(call, shapes, kinds, "cpu", low)
        except RuntimeError:  # scatter_add of a 16-bit self and an fp32 source, uncast on the CPU
            cpu = "error"
    differs = {"scatter_add", "softmax", "log_softmax", "layer_norm", "rms_norm", "group_norm", "exp", "pow", "rsqrt",
               "sum", "sum over a dim", "cumsum", "norm", "norm over a dim", "vector_norm"}
    assert (cpu != emulated) == (name in differs), (name, cpu, emulated)


def test_a_banned_op_raises_as_on_cuda() -> None:
    x = torch.rand(4)
    with autocast_as(cuda_autocast_policy()), torch.autocast("cpu", dtype=torch.float16):
        with pytest.raises(RuntimeError, match="binary_cross_entropy"):
            F.binary_cross_entropy(x, x)


def test_the_kernels_and_the_cache_hook_are_gone_after() -> None:
    clear = torch.clear_autocast_cache
    with pytest.raises(ZeroDivisionError):
        with autocast_as(cuda_autocast_policy()):
            assert torch.clear_autocast_cache is not clear
            1 / 0
    assert torch.clear_autocast_cache is clear
    x = torch.rand(4, H)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.softmax(x.bfloat16(), -1).dtype == torch.bfloat16  # CPU's list again: no policy for softmax
        assert torch.cat([x, x.bfloat16()]).dtype == torch.float32  # CPU's promote
        assert torch.mm(x, x.t()).dtype == torch.bfloat16


def test_a_bad_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="'fp64' for 'mm'"):
        with autocast_as({"mm": "fp64"}):
            pass


def test_a_trainable_weight_used_twice_is_cast_once_and_dropped_when_autocast_exits() -> None:
    weight = torch.nn.Parameter(torch.rand(3, H))
    x = torch.rand(4, H, requires_grad=True)  # so that mm saves the weight's cast
    with autocast_as(cuda_autocast_policy()):
        with torch.autocast("cpu", dtype=torch.float16):
            first, second = F.linear(x, weight), F.linear(x + 1, weight)
            assert first.dtype == second.dtype == torch.float16
            saved = [node._saved_mat2 for node in (first.grad_fn, second.grad_fn)]  # MmBackward's weight.t()
            assert saved[0].untyped_storage().data_ptr() == saved[1].untyped_storage().data_ptr()
        with torch.autocast("cpu", dtype=torch.float16):
            third = F.linear(x, weight)
        assert third.grad_fn._saved_mat2.untyped_storage().data_ptr() != saved[0].untyped_storage().data_ptr()


# -- the saved tensors of tiny models, op by op ----------------------------------------------------

def _saved_by_node(output: torch.Tensor) -> Dict[str, List[torch.dtype]]:
    """The dtypes of the floating tensors (not scalars) each kind of autograd node saved."""
    return saved_dtypes_by_node(output, keep=lambda tensor: tensor.is_floating_point() and tensor.dim() > 0)


def _tiny_bert() -> torch.nn.Module:
    config = BertConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                        vocab_size=100, max_position_embeddings=64)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return BertForMaskedLM(config).train()


def _tiny_llama(attn: str) -> torch.nn.Module:
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=100, max_position_embeddings=64)
    config._attn_implementation = attn
    torch.manual_seed(0)
    return LlamaForCausalLM(config).train()


def _loss(model: torch.nn.Module, low: torch.dtype, cuda: bool) -> torch.Tensor:
    ids = torch.randint(0, 100, (2, 16))
    policy = autocast_as(cuda_autocast_policy()) if cuda else torch.autocast("cpu", enabled=True, dtype=low)
    with policy, torch.autocast("cpu", dtype=low):
        return model(input_ids=ids, labels=ids).loss


@pytest.mark.parametrize("low", [torch.float16, torch.bfloat16])
def test_a_bert_saves_what_cuda_autocast_saves(low: torch.dtype) -> None:
    saved = _saved_by_node(_loss(_tiny_bert(), low, cuda=True))
    # fp32 list: the norms save their fp32 input; fp32_set_opt_dtype: softmax and log_softmax
    # save fp32 results; lower_precision_fp: the matmuls save 16-bit operands.
    assert set(saved["NativeLayerNormBackward0"]) == {torch.float32}
    assert set(saved["SoftmaxBackward0"]) == {torch.float32}
    # cross_entropy_loss has no policy on CUDA: it calls log_softmax with the logits' own dtype
    # (LossNLL.cpp), which fp32_set_opt_dtype keeps, and nll_loss (fp32) saves an fp32 copy.
    assert set(saved["LogSoftmaxBackward0"]) == {low}
    assert set(saved["NllLossBackward0"]) == {torch.float32}
    assert set(saved["AddmmBackward0"]) == {low}
    assert set(saved["BmmBackward0"]) == {low}
    # GELU has no policy: its input is the 16-bit output of the linear before it.
    assert set(saved["GeluBackward0"]) == {low}
    on_cpu = _saved_by_node(_loss(_tiny_bert(), low, cuda=False))
    assert set(on_cpu["SoftmaxBackward0"]) == {low}  # CPU autocast leaves the softmax in 16 bits
    assert set(on_cpu["LogSoftmaxBackward0"]) == {torch.float32}  # CPU casts the whole cross_entropy_loss


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_a_llama_saves_what_cuda_autocast_saves(attn: str) -> None:
    saved = _saved_by_node(_loss(_tiny_llama(attn), torch.bfloat16, cuda=True))
    assert set(saved["MmBackward0"]) == {torch.bfloat16}
    assert set(saved["PowBackward0"]) == {torch.float32}  # the RMSNorm upcasts before pow: fp32 either way
    assert set(saved["RsqrtBackward0"]) == {torch.float32}
    assert set(saved["LogSoftmaxBackward0"]) == {torch.float32}
    if attn == "eager":
        assert set(saved["SoftmaxBackward0"]) == {torch.float32}  # transformers' softmax(dtype=float32)
    else:
        assert set(saved["ScaledDotProductFlashAttentionForCpuBackward0"]) >= {torch.bfloat16}


# -- the mechanism, against CPU autocast itself -----------------------------------------------------

def _tiny_plan(kind: str, attn: str, precision: str, ckpt: bool) -> Any:
    from trainer_memcb.plan.answers.step_memory import plan_step_memory

    def build() -> torch.nn.Module:
        with torch.device("meta"):
            return _tiny_bert() if kind == "bert" else _tiny_llama(attn)

    plan, _ = plan_step_memory(build, batch_size=2, seq_len=16, precision=precision,
                               attn_implementation=attn, gradient_checkpointing=ckpt, model_states=False,
                               device_type="cpu")
    assert plan.step.problem is None
    return plan


@pytest.mark.parametrize("kind,attn,precision,ckpt", [
    ("bert", "eager", "autocast-bf16", False), ("bert", "sdpa", "autocast-fp16", True),
    ("llama", "sdpa", "autocast-bf16", True), ("llama", "eager", "autocast-fp16", False)])
def test_the_kernels_given_cpus_own_lists_plan_what_cpu_autocast_plans(monkeypatch: Any, kind: str, attn: str,
                                                                        precision: str, ckpt: bool) -> None:
    real = _tiny_plan(kind, attn, precision, ckpt)
    monkeypatch.setattr(trace, "autocast_policy_for", lambda device_type: cpu_autocast_table())
    emulated = _tiny_plan(kind, attn, precision, ckpt)
    assert emulated.to_dict() == real.to_dict()
    assert real.step.activations_bytes > 0
    monkeypatch.setattr(trace, "autocast_policy_for", lambda device_type: cuda_autocast_policy())
    as_on_cuda = _tiny_plan(kind, attn, precision, ckpt)
    if kind == "bert" and attn == "eager":  # the fp32 softmax, saved, and its fp32 dropout
        assert as_on_cuda.step.activations_bytes > real.step.activations_bytes
