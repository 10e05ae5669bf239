"""CUDA's autocast on the CPU trace: each op cast as `torch.autocast("cuda")` casts it.

The step is traced on fake CPU tensors, and `torch.autocast("cpu")` casts by CPU's op lists, which
are not CUDA's: on CUDA, `softmax`, `log_softmax`, `layer_norm`, `exp`, `pow`, `sum`, the losses
and others run in float32 and `addmm`, `mm`, `bmm`, `baddbmm`, `matmul`, `linear` and
`scaled_dot_product_attention` in the 16-bit type, while CPU's lists leave the softmax and the
norms in their input's type, cast the whole `cross_entropy_loss` to float32 and promote `cat` and
`stack`. What autograd saves follows the casts (a softmax saves its float32 output on CUDA, its
16-bit one on the CPU), so a plan for a CUDA run must cast as CUDA does.

Fake CUDA tensors cannot run a backward without a GPU (docs/cuda-kernels.md), so the trace stays
on the CPU and `autocast_as` puts CUDA's policy where autocast runs: for the duration, the
`AutocastCPU` dispatch key's kernels are replaced by Python kernels that cast by the table given
(`cuda_autocast_policy()`: CUDA's), and every other op falls through. The key sits above
autograd in the dispatcher, so the casts are recorded by autograd and the tensors saved for
backward are the cast ones, as with real autocast; the ops inside composite ones
(`cross_entropy_loss`'s `log_softmax` and `nll_loss`) are cast one by one, as on CUDA. Each kernel
follows `WrapFunction_` of its `CastPolicy` in torch's `aten/src/ATen/autocast_mode.h`
(`cached_cast`, `promote_type`/`prioritize`, `set_opt_dtype`, `type_from_firstarg`), including
`cached_cast`'s cache of the 16-bit copies of float32 leaves that require a gradient (the
trainable weights), kept until the outermost autocast region exits
(`aten/src/ATen/autocast_mode.cpp`: `cached_cast`, `clear_cache`).

The table. torch does not give the policies to Python: the dispatcher lists which ops have an
`AutocastCUDA` kernel (`torch._C._dispatch_get_registrations_for_dispatch_key`), not the
policy of each. The policies below are copied from torch 2.13's `aten/src/ATen/autocast_mode.h`
(`AT_FORALL_LOWER_PRECISION_FP`, `AT_FORALL_FP32`, `AT_FORALL_FP32_SET_OPT_DTYPE`,
`AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE`, `AT_FORALL_PROMOTE`) and
`aten/src/ATen/autocast_mode.cpp` (`TORCH_LIBRARY_IMPL(aten, AutocastCUDA, m)`: the same macros
plus `cudnn_convolution`, `cudnn_convolution_transpose` in lower precision and
`binary_cross_entropy` banned); `cuda_autocast_policy()` keeps those the running torch registers
for `AutocastCUDA`, so a release without an op does not cast it (`rms_norm` joined the fp32
list in torch 2.12, pytorch/pytorch#174824; before, it ran in its input's type). The tests hold
the copy against the dispatcher's registrations and against
torch's own `AutocastCUDA` kernels run on fake CUDA tensors (a forward needs no GPU).
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Dict, Iterator, List, Mapping, Optional, Tuple

import torch

__all__ = ["CAST_POLICIES", "CUDA_LOWER_PRECISION_FP", "CUDA_FP32", "CUDA_FP32_SET_OPT_DTYPE", "CUDA_FP32_APPEND_DTYPE",
           "CUDA_PROMOTE", "CUDA_BANNED", "CUDA_AUTOCAST_TABLE", "cuda_autocast_policy", "autocast_as",
           "autocast_policy_for", "registered_ops"]

CAST_POLICIES = ("lower_precision_fp", "fp32", "fp32_set_opt_dtype", "fp32_append_dtype", "promote")

# torch 2.13, aten/src/ATen/autocast_mode.h, AT_FORALL_LOWER_PRECISION_FP; autocast_mode.cpp adds the two cudnn ones.
CUDA_LOWER_PRECISION_FP = (
    "_convolution.deprecated", "_convolution", "conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d",
    "conv_transpose2d.input", "conv_transpose3d.input", "convolution", "prelu", "addmm", "addmv", "addr", "matmul",
    "einsum", "mm", "mv", "linalg_vecdot", "linear", "addbmm", "baddbmm", "bmm", "chain_matmul", "linalg_multi_dot",
    "_thnn_fused_lstm_cell", "_thnn_fused_gru_cell", "lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell",
    "_scaled_dot_product_flash_attention", "scaled_dot_product_attention",
    "cudnn_convolution", "cudnn_convolution_transpose")
# AT_FORALL_FP32
CUDA_FP32 = (
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt", "sinh",
    "tan", "pow.Tensor_Scalar", "pow.Tensor_Tensor", "pow.Scalar", "softplus", "layer_norm", "native_layer_norm",
    "rms_norm", "group_norm", "frobenius_norm.dim", "nuclear_norm", "nuclear_norm.dim", "cosine_similarity",
    "poisson_nll_loss", "cosine_embedding_loss", "nll_loss", "nll_loss2d", "hinge_embedding_loss", "kl_div", "l1_loss",
    "smooth_l1_loss", "huber_loss", "mse_loss", "margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss",
    "triplet_margin_loss", "multi_margin_loss", "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm",
    "logsumexp", "upsample_nearest1d", "_upsample_nearest_exact1d", "upsample_nearest2d", "_upsample_nearest_exact2d",
    "upsample_nearest3d", "_upsample_nearest_exact3d", "upsample_linear1d", "upsample_bilinear2d",
    "_upsample_bilinear2d_aa", "upsample_trilinear3d", "upsample_bicubic2d", "_upsample_bicubic2d_aa")
# AT_FORALL_FP32_SET_OPT_DTYPE
CUDA_FP32_SET_OPT_DTYPE = (
    "prod", "prod.dim_int", "softmax.int", "log_softmax.int", "cumprod", "cumsum", "linalg_vector_norm",
    "linalg_matrix_norm", "linalg_matrix_norm.str_ord", "sum", "sum.dim_IntList")
# AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE: the overload wrapped -> the one redispatched to, float32 appended.
CUDA_FP32_APPEND_DTYPE = {"norm.Scalar": "norm.ScalarOpt_dtype", "norm.ScalarOpt_dim": "norm.ScalarOpt_dim_dtype"}
# AT_FORALL_PROMOTE
CUDA_PROMOTE = ("addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "grid_sampler", "index_put",
                "tensordot", "scatter_add")
# autocast_mode.cpp: binary_cross_entropy_banned (an error under CUDA autocast).
CUDA_BANNED = ("binary_cross_entropy",)

CUDA_AUTOCAST_TABLE: Dict[str, str] = {
    **{name: "lower_precision_fp" for name in CUDA_LOWER_PRECISION_FP}, **{name: "fp32" for name in CUDA_FP32},
    **{name: "fp32_set_opt_dtype" for name in CUDA_FP32_SET_OPT_DTYPE},
    **{name: "fp32_append_dtype" for name in CUDA_FP32_APPEND_DTYPE}, **{name: "promote" for name in CUDA_PROMOTE},
    **{name: "banned" for name in CUDA_BANNED}}


def registered_ops(dispatch_key: str) -> List[str]:
    """The aten ops with a kernel of their own for `dispatch_key` in the running torch, as
    "name" (the default overload) or "name.overload"."""
    names = torch._C._dispatch_get_registrations_for_dispatch_key(dispatch_key)
    return sorted(name[len("aten::"):] for name in names if name.startswith("aten::"))


def cuda_autocast_policy() -> Dict[str, str]:
    """CUDA autocast's policy of each op the running torch registers for `AutocastCUDA`
    (`CUDA_AUTOCAST_TABLE`, restricted to those)."""
    registered = set(registered_ops("AutocastCUDA"))
    return {name: policy for name, policy in CUDA_AUTOCAST_TABLE.items() if name in registered}


def _overload(name: str) -> Any:
    packet, _, overload = name.partition(".")
    return getattr(getattr(torch.ops.aten, packet), overload or "default")


def _is_tensor_type(kind: Any) -> bool:
    return isinstance(kind, torch._C.TensorType)


class _Casts:
    """`cached_cast` and its cache, for CPU tensors (the trace's) cast to `lower` or float32."""

    def __init__(self) -> None:
        self.cache: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = {}

    @staticmethod
    def eligible(tensor: Any) -> bool:
        # is_eligible: defined, on the autocast device, floating point, not double.
        return (isinstance(tensor, torch.Tensor) and tensor.device.type == "cpu" and tensor.is_floating_point()
                and tensor.dtype != torch.float64)

    def cast(self, to: torch.dtype, tensor: Any) -> Any:
        if not self.eligible(tensor) or tensor.dtype == to:
            return tensor
        lower = torch.get_autocast_dtype("cpu")
        if (to == lower and tensor.dtype == torch.float32 and tensor.requires_grad and tensor.is_leaf
                and not tensor._is_view() and torch.is_autocast_cache_enabled()):
            hit = self.cache.get(id(tensor))
            if hit is not None and hit[0] is tensor:
                return hit[1]
            cast = tensor.to(to)
            # The source is kept alive with its cast, as the cache's weakref keeps its TensorImpl.
            self.cache[id(tensor)] = (tensor, cast)
            return cast
        return tensor.to(to)


class _Kernel:
    """One op's autocast kernel under `policy` (autocast_mode.h, `WrapFunction_<policy>::call`)."""

    def __init__(self, name: str, policy: str, casts: _Casts) -> None:
        self.name, self.policy, self.casts = name, policy, casts
        self.op = _overload(name)
        self.arguments = list(self.op._schema.arguments)
        self.target = _overload(CUDA_FP32_APPEND_DTYPE[name]) if policy == "fp32_append_dtype" else self.op

    def _values(self, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> List[Any]:
        values = []
        for index, argument in enumerate(self.arguments):
            if not argument.kwarg_only and index < len(args):
                values.append(args[index])
            elif argument.name in kwargs:
                values.append(kwargs[argument.name])
            else:
                values.append(argument.default_value)
        return values

    def _call(self, op: Any, values: List[Any], extra: Optional[Dict[str, Any]] = None) -> Any:
        positional = [v for a, v in zip(self.arguments, values) if not a.kwarg_only]
        keywords = {a.name: v for a, v in zip(self.arguments, values) if a.kwarg_only}
        keywords.update(extra or {})
        return op(*positional, **keywords)

    def _cast_all(self, to: torch.dtype, values: List[Any]) -> List[Any]:
        # cached_cast's overloads: Tensor, optional<Tensor>, TensorList; anything else (a list of
        # optional tensors, scalars) passes unchanged.
        out = []
        for argument, value in zip(self.arguments, values):
            kind = argument.type
            optional = isinstance(kind, torch._C.OptionalType) and _is_tensor_type(kind.getElementType())
            if _is_tensor_type(kind) or optional:
                value = self.casts.cast(to, value)
            elif isinstance(kind, torch._C.ListType) and _is_tensor_type(kind.getElementType()):
                value = [self.casts.cast(to, item) for item in value]
            out.append(value)
        return out

    def _promote_type(self, values: List[Any]) -> torch.dtype:
        # promote_type / prioritize: Tensor and TensorList arguments only (not optional ones).
        current = torch.get_autocast_dtype("cpu")
        tensors: List[Any] = []
        for argument, value in zip(self.arguments, values):
            kind = argument.type
            if _is_tensor_type(kind):
                tensors.append(value)
            elif isinstance(kind, torch._C.ListType) and _is_tensor_type(kind.getElementType()):
                tensors.extend(value)
        for tensor in tensors:
            if not self.casts.eligible(tensor):  # double tensors are ignored, as the others not eligible
                continue
            if current == torch.float32 or tensor.dtype == torch.float32:
                current = torch.float32
            elif tensor.dtype != current:
                raise RuntimeError("Unexpected floating ScalarType in at::autocast::prioritize")
        return current

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        values = self._values(args, kwargs)
        with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)):
            if self.policy == "lower_precision_fp":
                return self._call(self.op, self._cast_all(torch.get_autocast_dtype("cpu"), values))
            if self.policy == "fp32":
                return self._call(self.op, self._cast_all(torch.float32, values))
            if self.policy == "fp32_set_opt_dtype":
                if self.casts.eligible(values[0]):
                    values = [torch.float32 if (a.name == "dtype" and v is None) else v
                              for a, v in zip(self.arguments, values)]
                return self._call(self.op, values)
            if self.policy == "fp32_append_dtype":
                first = values[0]
                out_type = torch.float32 if self.casts.eligible(first) else first.dtype
                return self._call(self.target, values, {"dtype": out_type})
            if self.policy == "promote":
                return self._call(self.op, self._cast_all(self._promote_type(values), values))
            raise RuntimeError(f"torch.nn.functional.{self.name} is unsafe to autocast (banned under CUDA autocast)")


@contextlib.contextmanager
def autocast_as(policy: Mapping[str, str]) -> Iterator[None]:
    """Within: `torch.autocast("cpu", dtype=...)` casts by `policy` (op -> one of
    `CAST_POLICIES`, or "banned") instead of CPU's lists; the ops CPU autocast casts and `policy`
    does not name fall through. Autocast itself is entered by the caller (`torch.autocast("cpu",
    ...)`), as the Trainer enters it, so `torch.utils.checkpoint`'s recomputation, which enters it
    again, casts the same way."""
    for name, kind in policy.items():
        if kind not in CAST_POLICIES and kind != "banned":
            raise ValueError(f"policy {kind!r} for {name!r} is not one of: {', '.join(CAST_POLICIES + ('banned',))}")
    casts = _Casts()
    library = torch.library.Library("aten", "IMPL")
    clear = torch.clear_autocast_cache

    def clear_both() -> None:  # torch.autocast.__exit__ calls it when the outermost region exits
        casts.cache.clear()
        clear()

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "Overriding a previously registered kernel" for CPU's own ones
            for name, kind in policy.items():
                library.impl(name, _Kernel(name, kind, casts), "AutocastCPU")
            for name in registered_ops("AutocastCPU"):
                if name not in policy:
                    library.impl(name, torch.library.fallthrough_kernel, "AutocastCPU")
        torch.clear_autocast_cache = clear_both
        yield
    finally:
        torch.clear_autocast_cache = clear
        casts.cache.clear()
        library._destroy()


def autocast_policy_for(device_type: str) -> Optional[Dict[str, str]]:
    """The policy the trace casts by for a run on `device_type`: CUDA's (`cuda_autocast_policy`)
    for "cuda"; None for "cpu", where the trace runs `torch.autocast("cpu")` as it is."""
    return cuda_autocast_policy() if device_type == "cuda" else None
