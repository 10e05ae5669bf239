"""The Trainer's `torch_compile=True` step under fake tensors: the model's forward as `torch.compile`
runs it, what the compiled forward saves for backward chosen by AOTAutograd's min-cut partitioner.

With `torch_compile=True`, accelerate compiles the model the Trainer trains
(`Accelerator.prepare_model`: `torch.compile(model, **dynamo_plugin.to_kwargs())`, backend
"inductor" unless `torch_compile_backend` names another), and the loss is computed inside the
model's forward (HF models take `labels`). Inductor (`torch/_inductor/compile_fx.py`, `compile_fx`)
hands AOTAutograd the partitioner `min_cut_rematerialization_partition`
(`torch/_functorch/partitioners.py`), which picks the tensors the forward graph saves for backward
and recomputes the cheap ones in backward. Here dynamo captures the model's forward on the fake
model and batch, `aot_autograd` (`torch/_dynamo/backends/common.py`) partitions it with the same
partitioner, and the forward and backward graphs run as traced (`make_boxed_func`: no code is
generated), op by op under the plan's fake mode and its trackers: the saved tensors are the
partitioner's, the temporaries the graphs' own, each freed after its last use as the graph's code
frees it.

Inductor's code generation cannot run under fake tensors, so what it changes is not counted
(`COMPILED_NOT_COUNTED`): its fused kernels hold fewer temporaries than the graph's operations do,
and it holds buffers and workspaces of its own. The traced figure is the step without that fusion,
an upper bound of the Inductor step by what that names. On CUDA, the stand-ins of the attention
kernels (`plan.step.cuda_sdpa`, `plan.step.flash_attn`) allocate the workspaces a kernel holds
while it runs, which nothing reads: AOTAutograd's tracing drops them from the graph, so they are
named there too.

Dynamo runs no compiled frame while a dispatch mode that is not torch's own is on the stack
(`torch/_dynamo/convert_frame.py`: "non-infra torch dispatch mode present"; it runs the eager code
instead), unless the mode says `ignore_compile_internals()` (`torch/utils/_python_dispatch.py`:
the mode is off while dynamo compiles and on while the compiled graphs run). The model is compiled
by one forward and backward of its first micro-batch under the fake mode alone
(`CompiledForward.warm_up`), before anything is counted; then the step's tracker says
`ignore_compile_internals()`, so that the counted step runs the code dynamo cached and the tracker
sees each operation of its graphs. A forward in which the compiled graph did not run (dynamo fell back
to the eager code) raises `CompiledStepFailed`, so that the plan never prints the eager figure as
the compiled one.
"""

from __future__ import annotations

import contextlib
import types
from typing import Any, Dict, List

import torch
from torch import nn

__all__ = ["CompiledForward", "CompiledStepFailed", "COMPILED_NOT_COUNTED", "compiled_step_refusal"]

# What the compiled trace does not count: the plan's "not counted" line with torch_compile=True.
COMPILED_NOT_COUNTED = ("torch_compile=True: traced with AOTAutograd's min-cut partition (what the compiled "
                        "forward saves for backward), its graphs run as traced; not counted: Inductor's fused "
                        "kernels, which hold fewer temporaries than the graphs' operations (the figure is above "
                        "the Inductor step's by those), Inductor's own buffers and workspaces, and on CUDA the "
                        "workspaces an attention kernel holds while it runs (the graph drops the stand-ins' "
                        "allocations that nothing reads)")


class CompiledStepFailed(Exception):
    """The compiled step could not be traced under fake tensors; the message says why."""


def compiled_step_refusal(settings: Any) -> str:
    """Why the step of `settings` (resolved `StepSettings`) is not traced compiled, or "" where it
    is: on one process only (the engines wrap the model and run its backward in ways the compiled
    trace does not follow), and for the Trainer's own loss (TRL's trainers compute theirs outside
    the model's forward)."""
    if settings.sharding != "none" or getattr(settings, "tp_size", 1) > 1 or getattr(settings, "cp_size", 1) > 1 \
            or settings.precision.startswith("deepspeed-"):
        return "the compiled step is traced on one process without sharding only"
    if settings.preference is not None:
        return f"the compiled step is traced for the Trainer's own loss, not TRL's {settings.preference.trainer}"
    return ""


def _ignores_compile_internals() -> bool:
    return True


def _fresh_call(model: nn.Module) -> Any:
    """A function that calls `model`, its code object its own: dynamo keeps its compiled code on
    the code object of the frame it compiles, so a plan's compilation neither finds the ones of
    plans before it (other shapes, other fake models) nor counts towards their recompile limit, and
    goes with this function. The model's forward is inlined into its frame, as into the frame of
    `torch.compile(model)`."""
    def call(**kwargs: Any) -> Any:
        return model(**kwargs)

    return types.FunctionType(call.__code__.replace(), call.__globals__, call.__name__, call.__defaults__,
                              call.__closure__)


def _boxed_as_traced(runs: List[int]) -> Any:
    """An AOTAutograd compiler that returns each graph as traced, the runs of the n-th graph it
    compiles counted in `runs[n]`."""
    from functorch.compile import make_boxed_func

    def compiler(graph: torch.fx.GraphModule, example_inputs: Any) -> Any:
        boxed = make_boxed_func(graph)
        index = len(runs)
        runs.append(0)

        def run(args: List[Any]) -> Any:
            runs[index] += 1
            return boxed(args)

        run._boxed_call = True  # AOTAutograd hands it the list of inputs, which it may clear
        return run

    return compiler


class CompiledForward:
    """`model` compiled as the Trainer's `torch_compile=True` compiles it, with AOTAutograd's
    min-cut partition and the graphs run as traced (the module docstring).

    Call it as the model; `warm_up` first, outside every tracker."""

    def __init__(self, model: nn.Module) -> None:
        from torch._dynamo.backends.common import aot_autograd
        from torch._functorch.partitioners import min_cut_rematerialization_partition

        # The runs of each forward graph; the first is the model's own frame's (dynamo compiles it
        # first), the others any frame compiled after a graph break or inside it.
        self._forward_runs: List[int] = []
        backend = aot_autograd(fw_compiler=_boxed_as_traced(self._forward_runs),
                               bw_compiler=_boxed_as_traced([]),
                               partition_fn=min_cut_rematerialization_partition)
        self.model = model
        # Static shapes, as the Trainer's first compilation is (accelerate's `dynamic` None: shapes
        # turn dynamic only once they change).
        self.compiled = torch.compile(_fresh_call(model), backend=backend, dynamic=False)

    def warm_up(self, kwargs: Dict[str, Any], mode: Any, contexts: List[Any], autocast: Any, tracker: Any) -> None:
        """Compile: one forward and backward of `kwargs` inside `mode` and `contexts` (the step's own,
        its trackers left out), the gradients it made dropped; then let the dispatch mode `tracker`
        see the compiled graphs' operations (the module docstring)."""
        with contextlib.ExitStack() as stack:
            for context in contexts + [mode]:
                stack.enter_context(context)
            with autocast if autocast is not None else contextlib.nullcontext():
                loss = self(**kwargs)["loss"]
            loss.backward()
            del loss
        for parameter in self.model.parameters():
            parameter.grad = None
        tracker.ignore_compile_internals = _ignores_compile_internals

    def __call__(self, **kwargs: Any) -> Any:
        before = self._forward_runs[0] if self._forward_runs else 0
        try:
            outputs = self.compiled(**kwargs)
        except Exception as error:
            raise CompiledStepFailed(f"dynamo could not compile the forward under fake tensors "
                                     f"({type(error).__name__}: {' '.join(str(error).split())[:200]})") from error
        if not self._forward_runs or self._forward_runs[0] == before:
            raise CompiledStepFailed("dynamo ran the forward eagerly (its compiled graph did not run)")
        if outputs.get("loss") is None:
            raise CompiledStepFailed("the compiled forward returned no loss")
        return outputs
