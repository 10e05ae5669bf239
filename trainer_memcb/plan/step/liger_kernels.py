"""`TrainingArguments(use_liger_kernel=True)` planned without liger-kernel: stand-in autograd
Functions that allocate, save and free what liger-kernel's Triton kernels do on a GPU.

The Trainer (`Trainer.train`, transformers' `integrations/liger.py`) calls liger-kernel's
`_apply_liger_kernel_to_instance(model=<the base model>, **liger_kernel_config)`, which for Llama,
Mistral, Qwen2 and Qwen3 (`apply_liger_kernel_to_llama` and its siblings in
`liger_kernel/transformers/monkey_patch.py`) binds new forwards to the model instance and to its
modules: the causal LM's forward becomes `lce_forward` (`transformers/model/llama.py`), each
RMSNorm's `LigerRMSNorm.forward`, each MLP's `LigerSwiGLUMLP.forward`, and the modeling module's
`apply_rotary_pos_emb` becomes `liger_rotary_pos_emb`. `liger_kernels_as_cuda(model, ...)` does the
same for the duration of a trace, with the stand-ins below, and undoes it on exit.

The stand-ins are liger-kernel 0.8.5's (`LIGER_KERNEL_VERSION`) Functions with their torch code kept
line for line and each Triton kernel replaced by what it does to memory: nothing (it writes into
tensors the Function allocated). On fake tensors a kernel is skipped; on real CPU tensors it is
computed in torch (for the tests' values), through `.data`, as Triton's writes bypass autograd's
version counters.

- `FusedLinearCrossEntropyFunction` (`ops/fused_linear_cross_entropy.py`): the forward splits the
  BT rows into chunks (`chunk_rule`: `inc_factor = cdiv(V, H)`, `chunk_size =
  min(next_power_of_2(cdiv(BT, inc_factor)), BT)`), computes each chunk's logits, the
  cross-entropy kernel overwrites them with their gradient, and the gradients of the input
  (`grad_input`, BT x H) and of the weight (`grad_weight`, V x H) are accumulated in the forward
  and saved for backward, which only scales them. Allocated: `grad_input` and `grad_weight`
  (zeros), the fp32 `loss_1d` [BT], the target mask, and either one `logits_storage` [chunk, V]
  reused by every chunk (`_can_use_mm_out`: same dtypes, no autocast to another) or each chunk's
  own logits (under autocast, in its dtype) with the products' temporaries (`grad_input`'s rows,
  the legacy weight-gradient path's [V, H] `mm` and its `.float()`).
- `RMSNormFunction` (`ops/rms_norm.py`, casting mode "llama", in place): Y in X's dtype and an fp32
  RSTD [rows]; saves X, W, RSTD; the backward writes dX into dY and allocates `_dW` fp32
  [SMs, H], summed to dW.
- `SiLUMulFunction` (`ops/swiglu.py`): c = silu(a) * b in a new tensor; saves a and b; the backward
  writes da and db into a and b and returns them.
- `RopeFunction` (`ops/rope.py`, the Triton backend): rotates q and k in place (their storage, the
  projections' outputs); saves cos and sin; the backward rotates dq and dk in place (copies where
  they are not contiguous).
- `CrossEntropyFunction` (`ops/cross_entropy.py`, `cross_entropy=True` with the fused loss off): put in
  place of `torch.nn.functional.cross_entropy` for transformers' loss (over the fp32 logits it
  upcasts), the gradient written over its input, which is saved for backward; allocated: the loss
  per row and the target mask, and the bounds checks' temporaries.

The GPU's compute capability picks the weight gradient's path (Ampere or newer: cuBLAS's addmm into
the accumulator) and its SM count the size of RMSNorm's partial sums (the plan's GPU preset).

Not planned: z-loss, token scaling, label smoothing and class weights (lce_forward passes none of
them), `reduction="none"`, the CuTe DSL and cuTile backends (optional extras of liger-kernel; the
Triton kernels are its default), model types other than `LIGER_MODEL_TYPES`, DeepSpeed ZeRO-3's
partitioned LM head (lce_forward reads `lm_head.weight` outside the head's own forward; the plan
takes it as gathered).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
from torch import nn

from trainer_memcb.plan.settings.step_settings import LIGER_MODEL_TYPES, check_liger_kernel_config
from trainer_memcb.plan.step.kernel_runs import KernelRuns

__all__ = ["LIGER_KERNEL_VERSION", "LIGER_MODEL_TYPES", "LigerKernelsRun", "chunk_rule", "next_power_of_2",
           "FusedLinearCrossEntropyFunction", "CrossEntropyFunction", "RMSNormFunction", "SiLUMulFunction",
           "RopeFunction", "lce_forward", "liger_cross_entropy", "liger_rotary_pos_emb", "liger_kernels_as_cuda"]

# The release whose sources are modelled (liger_kernel-0.8.5, PyPI).
LIGER_KERNEL_VERSION = "0.8.5"
# ops/utils.py calculate_settings: a row wider than this is refused ("Cannot launch Triton kernel").
MAX_FUSED_SIZE = 65536
# fused_linear_cross_entropy.py: `_ADDMM_SUPPORTS_OUT_DTYPE = torch >= 2.8.0`, read from the installed torch.
_ADDMM_SUPPORTS_OUT_DTYPE = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 8)

_STATE: Dict[str, Any] = {"compute_capability": (8, 0), "sm_count": 108, "run": None}


class LigerKernelsRun(KernelRuns):
    """What `liger_kernels_as_cuda` patched and how often each stand-in ran."""

    def __init__(self, config: Dict[str, bool], sm_count: int) -> None:
        super().__init__()
        self.config, self.sm_count = dict(config), sm_count
        self.chunks: List[Tuple[int, int, int]] = []  # (BT, chunk_size, chunks) of each fused forward

    def note(self) -> Optional[str]:
        """The plan's note naming the kernels planned; None where none ran."""
        if not self.calls:
            return None
        kernels = self.calls_text()
        chunks = "".join(f"; the fused linear cross-entropy's {bt} rows in {n} chunks of {size}"
                         for bt, size, n in sorted(set(self.chunks)))
        return (f"use_liger_kernel: planned as liger-kernel {LIGER_KERNEL_VERSION}'s Triton kernels run on a GPU "
                f"(no liger-kernel package needed): {kernels}{chunks}")


def next_power_of_2(n: int) -> int:
    """`triton.next_power_of_2`: the least power of 2 at least n (1 for n <= 1)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def chunk_rule(bt: int, hidden: int, vocab: int, chunk_mem_const: int = 1) -> Tuple[int, int]:
    """(chunk_size, num_chunks) of `fused_linear_cross_entropy_forward`: the transient logits
    bounded to about BT x H elements."""
    inc_factor = _cdiv(vocab, chunk_mem_const * hidden)
    chunk_size = min(next_power_of_2(_cdiv(bt, inc_factor)), bt)
    return chunk_size, _cdiv(bt, chunk_size)


def _real(*tensors: torch.Tensor) -> bool:
    """Whether a kernel computes values: on real tensors (the tests'), not on fake ones (the plan's)."""
    from torch._subclasses.fake_tensor import FakeTensor

    return not any(isinstance(t, FakeTensor) for t in tensors)


def _count(kernel: str) -> None:
    if _STATE["run"] is not None:
        _STATE["run"].count(kernel)


def _autocast_dtype() -> Optional[torch.dtype]:
    """The dtype of the autocast the step runs under (CUDA's, traced as the CPU's), None without."""
    for device in ("cuda", "cpu"):
        if torch.is_autocast_enabled(device):
            return torch.get_autocast_dtype(device)
    return None


def _can_use_mm_out(_input: torch.Tensor, weight: torch.Tensor) -> bool:
    """`_can_use_mm_out` on CUDA (not ROCm), inside the Function's forward (grad mode off)."""
    if torch.is_grad_enabled() or _input.dtype != weight.dtype:
        return False
    if _input.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return False
    autocast = _autocast_dtype()
    return autocast is None or _input.dtype == autocast


# --- the Triton kernels: what they compute, on real tensors only -----------------------------------

def _cross_entropy_kernel(logits: torch.Tensor, target: torch.Tensor, loss: torch.Tensor, n_non_ignore: torch.Tensor,
                          ignore_index: int, reduction: str, has_gradients: bool) -> None:
    """`liger_cross_entropy_kernel`: each row's loss into `loss`, its gradient over the logits' own storage."""
    if not _real(logits):
        return
    x = logits.float()
    valid = target != ignore_index
    picked = target.clamp_min(0)
    row_loss = (torch.logsumexp(x, -1) - x.gather(1, picked[:, None])[:, 0]) * valid
    grad = torch.softmax(x, -1)
    grad[torch.arange(len(picked)), picked] -= 1
    grad *= valid[:, None]
    if reduction == "mean":
        row_loss, grad = row_loss / n_non_ignore, grad / n_non_ignore
    loss.data.copy_(row_loss)
    if has_gradients:
        logits.data.copy_(grad)


def _addmm_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """cuBLAS's `addmm(out, a, b, out=out)` (with `out_dtype` where out is wider): in place."""
    if _real(out):
        out.data.add_(torch.mm(a.to(out.dtype), b.to(out.dtype)))


def _element_mul(x: Optional[torch.Tensor], by: torch.Tensor) -> None:
    """`element_mul_kernel`: x scaled in place."""
    if x is not None and _real(x):
        x.data.mul_(by.to(x.dtype))


# --- ops/fused_linear_cross_entropy.py ------------------------------------------------------------

def _accumulate_grad_weight(grad_weight: torch.Tensor, grad_logits_chunk: torch.Tensor,
                            _input_chunk: torch.Tensor) -> None:
    """The weight gradient's three paths in `fused_linear_cross_entropy_forward`, on a GPU of the
    plan's compute capability."""
    grad_logits_t = grad_logits_chunk.t()
    ampere = _STATE["compute_capability"][0] >= 8
    low = grad_logits_t.dtype in (torch.float16, torch.bfloat16)
    if (_ADDMM_SUPPORTS_OUT_DTYPE and ampere and grad_weight.dtype == torch.float32 and low) or (
            ampere and low and grad_weight.dtype == grad_logits_t.dtype):
        input_chunk = _input_chunk
        if input_chunk.dtype != grad_logits_t.dtype:
            input_chunk = input_chunk.to(grad_logits_t.dtype)
        _addmm_into(grad_weight, grad_logits_t, input_chunk)
        del input_chunk
    else:
        # "Legacy fallback": a parameter-sized product (and its fp32 copy) per chunk.
        grad_weight += torch.mm(grad_logits_chunk.t(), _input_chunk).float()


def _fused_forward(_input: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, ignore_index: int,
                   reduction: str) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """`fused_linear_cross_entropy_forward` without bias, class weights, z-loss or token scaling:
    (loss, grad_input, grad_weight)."""
    input_requires_grad = _input.requires_grad
    bt, hidden = _input.shape
    vocab = weight.shape[0]
    chunk_size, num_chunks = chunk_rule(bt, hidden, vocab)
    if _STATE["run"] is not None:
        _STATE["run"].chunks.append((bt, chunk_size, num_chunks))
    grad_input = torch.zeros_like(_input)
    grad_weight = torch.zeros_like(weight) if input_requires_grad and weight.requires_grad else None
    loss_1d = torch.zeros(bt, dtype=torch.float32, device=_input.device)
    target_mask = target != ignore_index
    total_n_non_ignore = target_mask.sum()  # `.item()` in the source: a read, 0-dim here
    use_mm_out = _can_use_mm_out(_input, weight)
    logits_storage = torch.empty((chunk_size, vocab), dtype=_input.dtype, device=_input.device) if use_mm_out else None
    for chunk_id in range(num_chunks):
        start, end = chunk_id * chunk_size, min((chunk_id + 1) * chunk_size, bt)
        _input_chunk = _input[start:end]
        if logits_storage is not None:
            logits_chunk = logits_storage[: end - start]
            torch.mm(_input_chunk, weight.t(), out=logits_chunk)
        else:
            logits_chunk = _input_chunk @ weight.t()
        target_chunk = target[start:end].contiguous()
        logits_chunk = logits_chunk.contiguous()
        _cross_entropy_kernel(logits_chunk, target_chunk, loss_1d[start:end], total_n_non_ignore, ignore_index,
                              reduction, input_requires_grad)
        grad_logits_chunk = logits_chunk
        del logits_chunk
        if input_requires_grad:
            if use_mm_out and grad_logits_chunk.dtype == grad_input.dtype:
                torch.mm(grad_logits_chunk, weight, out=grad_input[start:end])
            else:
                grad_input[start:end] = grad_logits_chunk @ weight
        if grad_weight is not None and input_requires_grad:
            _accumulate_grad_weight(grad_weight, grad_logits_chunk, _input_chunk)
        del grad_logits_chunk, _input_chunk, target_chunk
    del logits_storage
    loss = torch.sum(loss_1d)
    grad_weight = grad_weight.to(weight.dtype) if grad_weight is not None else None
    return loss, grad_input, grad_weight


class FusedLinearCrossEntropyFunction(torch.autograd.Function):
    """`LigerFusedLinearCrossEntropyFunction` (reduction "mean" or "sum"): the gradients computed in
    the forward, saved, and scaled by the loss's gradient in the backward."""

    @staticmethod
    def forward(ctx: Any, _input: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, ignore_index: int = -100,
                reduction: str = "mean") -> torch.Tensor:
        _count("fused_linear_cross_entropy")
        loss, grad_input, grad_weight = _fused_forward(_input, weight, target, ignore_index, reduction)
        ctx.save_for_backward(grad_input.detach(), grad_weight.detach() if grad_weight is not None else None)
        return loss

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> Tuple[Optional[torch.Tensor], ...]:
        grad_input, grad_weight = ctx.saved_tensors
        # `torch.equal(grad_output, torch.tensor(1.0, device=...))`: a 4-byte tensor on the device.
        one = torch.tensor(1.0, device=grad_output.device)
        if not _real(grad_output) or not torch.equal(grad_output, one):
            _element_mul(grad_input, grad_output)
            _element_mul(grad_weight, grad_output)
        del one
        return grad_input, grad_weight, None, None, None


def _causal_lm_loss(lm_head: nn.Module, hidden_states: torch.Tensor, labels: torch.Tensor, hidden_size: int,
                    num_items_in_batch: Any = None, ignore_index: int = -100, **_: Any) -> torch.Tensor:
    """`LigerForCausalLMLoss` and `fixed_fused_linear_cross_entropy` (model/loss_utils.py)."""
    labels = nn.functional.pad(labels, (0, 1), value=ignore_index)
    shift_labels = labels[..., 1:].contiguous()
    hidden_states = hidden_states.view(-1, hidden_size)
    shift_labels = shift_labels.view(-1)
    reduction = "sum" if num_items_in_batch is not None else "mean"
    weight = getattr(getattr(lm_head, "modules_to_save", {}), "default", lm_head).weight  # PEFT's wrapper
    loss = FusedLinearCrossEntropyFunction.apply(hidden_states, weight, shift_labels, ignore_index, reduction)
    return loss / num_items_in_batch if reduction == "sum" else loss


def lce_forward(self: nn.Module, input_ids: Any = None, attention_mask: Any = None, position_ids: Any = None,
                past_key_values: Any = None, inputs_embeds: Any = None, labels: Any = None, use_cache: Any = None,
                logits_to_keep: Any = 0, skip_logits: Optional[bool] = None, **kwargs: Any) -> Any:
    """`lce_forward` (model/llama.py; qwen2.py, mistral.py, qwen3.py alike): in training with labels,
    the loss from the last hidden states through the fused kernel, no logits made."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    if past_key_values is not None:  # transformers 5 names it `cache`, and warns at the old name
        kwargs["past_key_values"] = past_key_values
    outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         inputs_embeds=inputs_embeds, use_cache=use_cache, **kwargs)
    hidden_states = outputs[0]
    slice_indices = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
    kept_hidden_states = hidden_states[:, slice_indices, :]
    if skip_logits is None:
        skip_logits = self.training and labels is not None
    logits = loss = None
    if skip_logits:
        loss = _causal_lm_loss(self.lm_head, kept_hidden_states, labels, self.config.hidden_size, **kwargs)
    else:
        logits = self.lm_head(kept_hidden_states)
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
    return CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=getattr(outputs, "past_key_values", None),
                                  hidden_states=getattr(outputs, "hidden_states", None),
                                  attentions=getattr(outputs, "attentions", None))


# --- ops/cross_entropy.py ---------------------------------------------------------------------------

class CrossEntropyFunction(torch.autograd.Function):
    """`LigerCrossEntropyFunction` (no class weights, z-loss, smoothing or softcap): the loss per row,
    the gradient written over the input's own storage and saved for backward."""

    @staticmethod
    def forward(ctx: Any, _input: torch.Tensor, target: torch.Tensor, ignore_index: int = -100,
                reduction: str = "mean") -> torch.Tensor:
        _count("cross_entropy")
        input_requires_grad = _input.requires_grad
        loss_1d = torch.zeros(_input.shape[0], dtype=_input.dtype, device=_input.device)
        target_mask = target != ignore_index
        n_non_ignore = target_mask.sum()  # `.item()` in the source: a read, 0-dim here
        # The source's bounds checks, each a 0-dim bool read by an assert: the products and extrema are made.
        in_bounds = [(target * target_mask).max() < _input.shape[-1], (target * target_mask).min() >= 0]
        del in_bounds
        if _input.stride(-1) != 1:
            _input = _input.contiguous()
        if target.stride(-1) != 1:
            target = target.contiguous()
        _cross_entropy_kernel(_input, target, loss_1d, n_non_ignore, ignore_index, reduction, input_requires_grad)
        loss = loss_1d if reduction == "none" else torch.sum(loss_1d)
        if input_requires_grad:
            ctx.save_for_backward(_input.detach())
        return loss

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> Tuple[Optional[torch.Tensor], ...]:
        (_input,) = ctx.saved_tensors
        one = torch.tensor(1.0, device=grad_output.device)  # torch.equal's operand, as in the backward
        if grad_output.ndim > 0:
            _input = _input * grad_output.unsqueeze(dim=1)
        elif not _real(grad_output) or not torch.equal(grad_output, one):
            _element_mul(_input, grad_output)
        return _input, None, None, None


def liger_cross_entropy(input: torch.Tensor, target: torch.Tensor, weight: Any = None, size_average: Any = None,
                        ignore_index: int = -100, reduce: Any = None, reduction: str = "mean",
                        label_smoothing: float = 0.0) -> torch.Tensor:
    """`liger_cross_entropy` (transformers/functional.py), as liger-kernel puts it in place of
    `torch.nn.functional.cross_entropy` for transformers' loss."""
    if weight is not None or label_smoothing:
        raise NotImplementedError("liger's cross_entropy with class weights or label smoothing is not planned")
    return CrossEntropyFunction.apply(input, target, ignore_index, reduction)


# --- ops/rms_norm.py --------------------------------------------------------------------------------

class RMSNormFunction(torch.autograd.Function):
    """`LigerRMSNormFunction` in the "llama" casting mode, offset 0, in place (as `_patch_rms_norm_module`)."""

    @staticmethod
    def forward(ctx: Any, X: torch.Tensor, W: torch.Tensor, eps: float) -> torch.Tensor:
        _count("rms_norm")
        X, W = X.contiguous(), W.contiguous()  # ensure_contiguous
        shape = X.shape
        X = X.view(-1, shape[-1])
        if next_power_of_2(shape[-1]) > MAX_FUSED_SIZE:
            raise RuntimeError(f"Cannot launch Triton kernel since n = {shape[-1]} exceeds the recommended Triton "
                               f"blocksize = {MAX_FUSED_SIZE}.")
        Y = torch.empty(X.shape, dtype=X.dtype, device=X.device)
        RSTD = torch.empty(X.shape[0], dtype=torch.float32, device=X.device)
        if _real(X):
            rstd = torch.rsqrt(X.float().pow(2).mean(-1) + eps)
            RSTD.data.copy_(rstd)
            Y.data.copy_((X.float() * rstd[:, None]).to(X.dtype) * W)
        ctx.save_for_backward(X, W, RSTD)
        return Y.view(*shape)

    @staticmethod
    def backward(ctx: Any, dY: torch.Tensor) -> Tuple[Optional[torch.Tensor], ...]:
        dY = dY.contiguous()
        X, W, RSTD = ctx.saved_tensors
        shape = dY.shape
        dY = dY.view(-1, shape[-1])
        _dW = torch.empty((_STATE["sm_count"], shape[-1]), dtype=torch.float32, device=W.device)
        dX = dY  # in_place=True: dX is written over dY
        if _real(dY):
            normed = X.float() * RSTD[:, None]
            weighted = dY.float() * W.float()
            grad = RSTD[:, None] * (weighted - normed * (weighted * normed).mean(-1, keepdim=True))
            _dW.data.zero_()
            _dW.data[0] = (dY.float() * normed.to(X.dtype).float()).sum(0)
            dX.data.copy_(grad)
        dW = _dW.sum(dim=0).to(W.dtype)
        return dX.view(*shape), dW, None


def _rms_norm_forward(module: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """`LigerRMSNorm.forward` bound to a model's RMSNorm (its `variance_epsilon`, or `eps`)."""
    eps = getattr(module, "variance_epsilon", None) or getattr(module, "eps", None) or 1e-6
    return RMSNormFunction.apply(hidden_states, module.weight, eps)


# --- ops/swiglu.py ---------------------------------------------------------------------------------

class SiLUMulFunction(torch.autograd.Function):
    """`LigerSiLUMulFunction` (multipliers 1): c = silu(a) * b; a and b saved, overwritten by their gradients."""

    @staticmethod
    def forward(ctx: Any, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        _count("swiglu")
        a, b = a.contiguous(), b.contiguous()  # ensure_contiguous
        c = torch.empty_like(a)
        if _real(a):
            c.data.copy_(torch.nn.functional.silu(a.float()).to(b.dtype) * b)
        ctx.save_for_backward(a, b)
        return c

    @staticmethod
    def backward(ctx: Any, dc: torch.Tensor) -> Tuple[Optional[torch.Tensor], ...]:
        dc = dc.contiguous()
        a, b = ctx.saved_tensors
        if _real(dc):
            sig = torch.sigmoid(a.float())
            silu = a.float() * sig
            da = dc.float() * (silu * (1 - sig) + sig) * b.float()
            db = dc.float() * silu
            a.data.copy_(da)
            b.data.copy_(db)
        return a, b


def _swiglu_forward(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`LigerSwiGLUMLP.forward` bound to a model's MLP."""
    return module.down_proj(SiLUMulFunction.apply(module.gate_proj(x), module.up_proj(x)))


# --- ops/rope.py -----------------------------------------------------------------------------------

def _rotate_in_place(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """`_triton_rope` on [B, T, H, D] q and k, cos and sin [B or 1, T, D]: q·cos + rotate_half(q)·sin."""
    if not _real(q):
        return
    for x in (q, k):
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        x.data.copy_(x * cos[:, :, None] + rotated * sin[:, :, None])


def _cos_sin(cos: torch.Tensor, sin: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """rope_forward's handling of 4-D and 2-D cos and sin (views)."""
    if cos.ndim == 4:
        cos, sin = cos.squeeze(1), sin.squeeze(1)
    if cos.ndim == 2:
        cos, sin = cos.unsqueeze(0), sin.unsqueeze(0)
    return cos, sin


class RopeFunction(torch.autograd.Function):
    """`LigerRopeFunction`: q and k [B, H, T, D] rotated in their own storage; cos and sin saved."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> Any:
        _count("rope")
        cos, sin = _cos_sin(cos, sin)
        q, k = q.transpose(1, 2).contiguous(), k.transpose(1, 2).contiguous()
        cos, sin = cos.contiguous(), sin.contiguous()
        _rotate_in_place(q, k, cos, sin)
        ctx.save_for_backward(cos, sin)
        return q.transpose(1, 2), k.transpose(1, 2)

    @staticmethod
    def backward(ctx: Any, dq: torch.Tensor, dk: torch.Tensor) -> Tuple[Optional[torch.Tensor], ...]:
        cos, sin = ctx.saved_tensors
        dq, dk = dq.transpose(1, 2).contiguous(), dk.transpose(1, 2).contiguous()
        if _real(dq):
            _rotate_in_place(dq, dk, cos, -sin)  # BACKWARD_PASS: the rotation by -θ
        return dq.transpose(1, 2), dk.transpose(1, 2), None, None


def liger_rotary_pos_emb(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         position_ids: Any = None, unsqueeze_dim: int = 1) -> Tuple[torch.Tensor, torch.Tensor]:
    """`liger_rotary_pos_emb` as the Triton backend runs it."""
    return RopeFunction.apply(q, k, cos, sin)


# --- the patching -----------------------------------------------------------------------------------

def _base_model(model: nn.Module) -> nn.Module:
    """`unwrap_peft_model`: the PreTrainedModel under a PEFT wrapper."""
    return model.get_base_model() if hasattr(model, "peft_config") and hasattr(model, "get_base_model") else model


def _patch_instance(model: nn.Module, kernels: Dict[str, bool], patched: List[nn.Module]) -> None:
    """Bind the stand-in forwards as `apply_liger_kernel_to_<model>(model=...)` binds liger-kernel's;
    each module whose instance `forward` was set goes into `patched` as it is set, so that a
    failure half-way leaves the caller the list to undo."""

    def bind(module: nn.Module, forward: Any) -> None:
        module.__dict__["forward"] = functools.partial(forward, module)
        patched.append(module)

    if kernels["fused_linear_cross_entropy"]:
        bind(model, lce_forward)
    base = getattr(model, model.base_model_prefix, model)
    norms = [base.norm] if kernels["rms_norm"] else []
    for layer in base.layers:
        if kernels["swiglu"]:
            bind(layer.mlp, _swiglu_forward)
        if kernels["rms_norm"]:
            norms += [layer.input_layernorm, layer.post_attention_layernorm]
            norms += [getattr(layer.self_attn, name) for name in ("q_norm", "k_norm")
                      if model.config.model_type == "qwen3"]
    for norm in norms:
        bind(norm, _rms_norm_forward)


@contextlib.contextmanager
def liger_kernels_as_cuda(model: nn.Module, config: Optional[Dict[str, Any]], compute_capability: Tuple[int, int],
                          sm_count: int) -> Iterator[LigerKernelsRun]:
    """Within: `model` (or the model under its PEFT wrapper) runs the stand-ins as the Trainer's
    `apply_liger_kernel(model, liger_kernel_config)` would run liger-kernel's on a GPU of
    `compute_capability` with `sm_count` SMs. Everything is undone on exit. Yields the record of
    what ran.

    Raises:
        ValueError: a model type liger-kernel patches that is not planned here, or a bad config.
    """
    kernels = check_liger_kernel_config(config)
    base = _base_model(model)
    model_type = getattr(getattr(base, "config", None), "model_type", None)
    if model_type not in LIGER_MODEL_TYPES:
        raise ValueError(f"use_liger_kernel with model type {model_type!r} is not planned: liger-kernel's kernels "
                         f"are planned for {', '.join(LIGER_MODEL_TYPES)}")
    modeling = importlib.import_module(LIGER_MODEL_TYPES[model_type])
    saved_state, original_rope = dict(_STATE), modeling.apply_rotary_pos_emb
    original_cross_entropy = nn.functional.cross_entropy
    run = LigerKernelsRun(kernels, sm_count)
    patched: List[nn.Module] = []
    try:
        _patch_instance(base, kernels, patched)
        _STATE.update(compute_capability=tuple(compute_capability), sm_count=sm_count, run=run)
        if kernels["rope"]:
            modeling.apply_rotary_pos_emb = liger_rotary_pos_emb
        if kernels["cross_entropy"]:
            # `from transformers.loss.loss_utils import nn; nn.functional.cross_entropy = liger_cross_entropy`:
            # torch's own function, for the process (here, for the trace).
            nn.functional.cross_entropy = liger_cross_entropy
        yield run
    finally:
        modeling.apply_rotary_pos_emb = original_rope
        nn.functional.cross_entropy = original_cross_entropy
        for module in patched:
            module.__dict__.pop("forward", None)
        _STATE.clear()
        _STATE.update(saved_state)
