"""measure_optimizer_state on real optimizers and real tensors: exact bytes, worked out here from
the parameter shapes, never read back from the code under test."""

from __future__ import annotations

import doctest
import importlib
import math
import pkgutil
from typing import Any, Dict, List, Sequence

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import trainer_memcb
from trainer_memcb import measure_optimizer_state

FLOAT32 = 4
STEP_BYTES = 4  # torch's `step`: a 0-dim float32 tensor per parameter tensor
QMAP_BYTES = 256 * FLOAT32  # a 256-entry float32 quantization map (bitsandbytes, torchao 8-bit)


def element_bytes(dtype: torch.dtype) -> int:
    return (torch.finfo(dtype).bits if dtype.is_floating_point else torch.iinfo(dtype).bits) // 8


def tensor_bytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    return math.prod(shape) * element_bytes(dtype)


def backward_and_step(optimizer: Any, params: Sequence[torch.Tensor]) -> None:
    sum(param.float().sum() for param in params).backward()
    optimizer.step()


class OpRecorder(TorchDispatchMode):
    """Records every aten op dispatched while it is active: a copy, `.item()`, any kernel at all."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: List[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def measure_recording_ops(optimizer: Any) -> Any:
    with OpRecorder() as recorder:
        measurement = measure_optimizer_state(optimizer)
    assert recorder.ops == []
    return measurement


@pytest.fixture
def no_cuda_sync(monkeypatch: pytest.MonkeyPatch) -> List[Any]:
    """Counts calls to `torch.cuda.synchronize` (a spy: the real one cannot run on a CPU build)."""
    calls: List[Any] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args, **kwargs: calls.append(args))
    return calls


def test_op_recorder_sees_item_and_copies() -> None:
    # The metadata-only assertions below mean something only if the recorder catches these.
    value = torch.ones(3)
    with OpRecorder() as recorder:
        value.sum().item()
        value.clone()
    assert recorder.ops == ["aten.sum.default", "aten._local_scalar_dense.default", "aten.clone.default"]


# -- plain torch AdamW -------------------------------------------------------------------------

ADAMW_SHAPES = [((3, 5), torch.float32), ((3,), torch.float32), ((4, 6), torch.bfloat16)]


def adamw_params() -> List[torch.nn.Parameter]:
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(shape).to(dtype)) for shape, dtype in ADAMW_SHAPES]


def expected_adamw(shapes=ADAMW_SHAPES) -> Dict[str, Any]:
    moment_bytes = sum(tensor_bytes(shape, dtype) for shape, dtype in shapes)
    values = sum(math.prod(shape) for shape, _ in shapes)
    by_dtype: Dict[str, int] = {"float32": STEP_BYTES * len(shapes)}
    for shape, dtype in shapes:
        name = str(dtype).replace("torch.", "")
        by_dtype[name] = by_dtype.get(name, 0) + 2 * tensor_bytes(shape, dtype)
    return {
        "num_bytes": 2 * moment_bytes + STEP_BYTES * len(shapes),
        "num_elements": 2 * values + len(shapes),
        "num_tensors": 3 * len(shapes),
        "num_params_with_state": len(shapes),
        "bytes_by_key": {"step": STEP_BYTES * len(shapes), "exp_avg": moment_bytes, "exp_avg_sq": moment_bytes},
        "bytes_by_dtype": by_dtype,
        "bytes_by_device": {"cpu": 2 * moment_bytes + STEP_BYTES * len(shapes)},
        "elements_by_key": {"step": len(shapes), "exp_avg": values, "exp_avg_sq": values},
    }


def test_adamw_after_one_step_exact(no_cuda_sync: List[Any]) -> None:
    params = adamw_params()
    optimizer = torch.optim.AdamW(params)
    backward_and_step(optimizer, params)

    measured = measure_recording_ops(optimizer)

    expected = expected_adamw()
    # (15 + 3 + 24) values x 2 moments + 3 steps; bf16 moments take 2 bytes a value.
    assert expected["num_bytes"] == 2 * (15 * 4 + 3 * 4 + 24 * 2) + 3 * 4 == 252
    assert measured.to_dict() == expected
    assert measured.bytes_by_dtype == {"float32": 12 + 2 * 72, "bfloat16": 96}
    assert not measured.is_empty
    assert no_cuda_sync == []


def test_empty_state_before_first_step() -> None:
    optimizer = torch.optim.AdamW(adamw_params())
    measured = measure_optimizer_state(optimizer)
    assert measured.is_empty
    assert measured.num_bytes == 0
    assert measured.num_elements == 0
    assert measured.num_tensors == 0
    assert measured.num_params_with_state == 0
    assert measured.bytes_by_key == {} and measured.bytes_by_dtype == {} and measured.bytes_by_device == {}


def test_measuring_adds_no_state_entry() -> None:
    torch.manual_seed(0)
    used = torch.nn.Parameter(torch.randn(4, 2))
    unused = torch.nn.Parameter(torch.randn(7))  # trains, but never gets a gradient
    frozen = torch.nn.Parameter(torch.randn(5), requires_grad=False)
    optimizer = torch.optim.AdamW([used, unused, frozen])
    backward_and_step(optimizer, [used])
    assert isinstance(optimizer.state, dict) and optimizer.state.default_factory is dict
    assert list(optimizer.state) == [used]

    measured = measure_optimizer_state(optimizer)

    assert list(optimizer.state) == [used]
    assert measured.num_params_with_state == 1
    assert measured.num_bytes == 2 * 8 * FLOAT32 + STEP_BYTES == 68


# -- wrappers ----------------------------------------------------------------------------------


@pytest.fixture
def fresh_accelerate_state():
    # accelerate keeps its state in process-wide singletons; leave none behind for other tests.
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


def test_unwraps_accelerated_optimizer(fresh_accelerate_state: None) -> None:
    from accelerate import Accelerator
    from accelerate.optimizer import AcceleratedOptimizer

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.Linear(3, 2))
    model, optimizer = Accelerator(cpu=True).prepare(model, torch.optim.AdamW(model.parameters()))
    assert isinstance(optimizer, AcceleratedOptimizer)
    model(torch.ones(2, 5)).sum().backward()
    optimizer.step()

    measured = measure_recording_ops(optimizer)

    shapes = [((3, 5), torch.float32), ((3,), torch.float32), ((2, 3), torch.float32), ((2,), torch.float32)]
    assert measured.to_dict() == expected_adamw(shapes)
    assert measured.num_bytes == 2 * 4 * (15 + 3 + 6 + 2) + 4 * 4 == 224
    assert measured == measure_optimizer_state(optimizer.optimizer)


def layer_wise_optimizer_dict(params: Sequence[torch.nn.Parameter]) -> Dict[torch.Tensor, torch.optim.Optimizer]:
    """One optimizer per parameter, stepped by a post-accumulate-grad hook, as
    `transformers.trainer_optimizer` builds them for layer-wise GaLore."""
    optimizer_dict = {param: torch.optim.AdamW([{"params": [param]}]) for param in params}

    def optimizer_hook(param: torch.Tensor) -> None:
        if param.grad is not None:
            optimizer_dict[param].step()
            optimizer_dict[param].zero_grad()

    for param in params:
        param.register_post_accumulate_grad_hook(optimizer_hook)
    return optimizer_dict


def test_unwraps_layer_wise_dummy_optimizer(fresh_accelerate_state: None) -> None:
    from accelerate import Accelerator
    from accelerate.optimizer import AcceleratedOptimizer
    from transformers.trainer_pt_utils import LayerWiseDummyOptimizer

    params = adamw_params()
    optimizer_dict = layer_wise_optimizer_dict(params)
    dummy = LayerWiseDummyOptimizer(optimizer_dict=optimizer_dict, lr=1e-3)
    sum(param.float().sum() for param in params).backward()  # the hooks step each optimizer
    assert all(len(optimizer_dict[param].state) == 1 for param in params)
    assert len(dummy.state) == 0  # the dummy's own placeholder parameter never steps

    measured = measure_recording_ops(dummy)

    assert measured.to_dict() == expected_adamw()
    # The Trainer hands callbacks the dummy inside accelerate's wrapper.
    wrapped = Accelerator(cpu=True).prepare_optimizer(dummy)
    assert isinstance(wrapped, AcceleratedOptimizer)
    assert measure_optimizer_state(wrapped) == measured


def test_unwraps_chains_of_optimizer_attributes() -> None:
    class Wrapper:
        def __init__(self, optimizer: Any) -> None:
            self.optimizer = optimizer
            self.param_groups = optimizer.param_groups
            self.state: Dict[Any, Any] = {}  # a wrapper's own state is not the real one

    params = adamw_params()
    optimizer = torch.optim.AdamW(params)
    backward_and_step(optimizer, params)

    measured = measure_optimizer_state(Wrapper(Wrapper(Wrapper(optimizer))))

    assert measured.to_dict() == expected_adamw()


# -- quantized states: tensor subclasses and shared maps ---------------------------------------


@pytest.mark.parametrize("optimizer_name", ["AdamW8bit", "AdamW4bit"])
def test_torchao_quantized_state_counts_inner_tensors(optimizer_name: str, no_cuda_sync: List[Any]) -> None:
    torchao_optim = pytest.importorskip("torchao.optim")
    torch.manual_seed(0)
    big = torch.nn.Parameter(torch.randn(64, 128))  # 8192 values: quantized (>= 4096, whole blocks)
    small = torch.nn.Parameter(torch.randn(10))  # too small to quantize: plain fp32 moments
    optimizer = getattr(torchao_optim, optimizer_name)([big, small])
    backward_and_step(optimizer, [big, small])
    subclass_state = optimizer.state[big]["exp_avg"]
    assert type(subclass_state) is not torch.Tensor and subclass_state.shape == big.shape

    measured = measure_recording_ops(optimizer)

    n = 64 * 128
    if optimizer_name == "AdamW8bit":  # codes uint8[N], scale fp32[N/256], qmap fp32[256]
        codes, scales, qmap = n, n // 256, 256
    else:  # codes uint8[N/2] (two 4-bit codes a byte), scale fp32[N/128], qmap fp32[16]
        codes, scales, qmap = n // 2, n // 128, 16
    quantized_moment = codes + FLOAT32 * (scales + qmap)
    small_moment = 10 * FLOAT32
    assert measured.num_bytes == 2 * STEP_BYTES + 2 * quantized_moment + 2 * small_moment
    assert measured.num_elements == 2 + 2 * (codes + scales + qmap) + 2 * 10
    assert measured.bytes_by_key == {
        "step": 2 * STEP_BYTES,
        "exp_avg": quantized_moment + small_moment,
        "exp_avg_sq": quantized_moment + small_moment,
    }
    assert measured.bytes_by_dtype == {"uint8": 2 * codes, "float32": measured.num_bytes - 2 * codes}
    # codes + scale + qmap for each quantized moment, a tensor for each step and plain moment.
    assert measured.num_tensors == 2 * 3 + 2 + 2
    if optimizer_name == "AdamW8bit":
        assert measured.num_bytes == 8 + 2 * 9344 + 2 * 40 == 18776
    else:
        assert measured.num_bytes == 8 + 2 * 4416 + 2 * 40 == 8920

    # What a naive sum of numel() * element_size() says: the logical fp32 shape, 4 bytes a value.
    naive = sum(
        value.numel() * value.element_size()
        for state in optimizer.state.values()
        for value in state.values()
    )
    assert naive == 2 * STEP_BYTES + 2 * n * FLOAT32 + 2 * small_moment == 65624
    assert naive - measured.num_bytes == 2 * (n * FLOAT32 - quantized_moment)
    assert no_cuda_sync == []


def test_bitsandbytes_shared_qmaps_counted_once(no_cuda_sync: List[Any]) -> None:
    bnb = pytest.importorskip("bitsandbytes")
    torch.manual_seed(0)
    first = torch.nn.Parameter(torch.randn(64, 128))  # 8192 values: 8-bit state
    second = torch.nn.Parameter(torch.randn(4096))  # exactly min_8bit_size: 8-bit state
    small = torch.nn.Parameter(torch.randn(10))  # below min_8bit_size: two fp32 buffers
    optimizer = bnb.optim.AdamW8bit([first, second, small])
    backward_and_step(optimizer, [first, second, small])
    # The premise: one qmap pair serves every 8-bit parameter.
    assert optimizer.state[first]["qmap1"] is optimizer.state[second]["qmap1"]
    assert optimizer.state[first]["qmap2"] is optimizer.state[second]["qmap2"]

    measured = measure_recording_ops(optimizer)

    def eight_bit(n: int) -> int:  # state1 + state2 uint8, absmax1 + absmax2 fp32 per 256-block
        return 2 * n + 2 * FLOAT32 * math.ceil(n / 256)

    assert measured.bytes_by_key["qmap1"] == QMAP_BYTES
    assert measured.bytes_by_key["qmap2"] == QMAP_BYTES
    assert measured.num_bytes == eight_bit(8192) + eight_bit(4096) + 2 * 10 * FLOAT32 + 2 * QMAP_BYTES
    assert measured.num_bytes == 16640 + 8320 + 80 + 2048 == 27088
    assert measured.bytes_by_key == {
        "state1": 8192 + 4096 + 40,
        "state2": 8192 + 4096 + 40,
        "absmax1": 4 * (32 + 16),
        "absmax2": 4 * (32 + 16),
        "qmap1": QMAP_BYTES,
        "qmap2": QMAP_BYTES,
    }
    assert measured.bytes_by_dtype == {"uint8": 2 * (8192 + 4096), "float32": 27088 - 2 * (8192 + 4096)}
    assert measured.num_params_with_state == 3
    assert no_cuda_sync == []


# -- DTensor -----------------------------------------------------------------------------------


@pytest.fixture
def one_process_group(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
    assert not dist.is_initialized()


def test_dtensor_counts_local_shard(one_process_group: None) -> None:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    mesh = DeviceMesh("cpu", [0])
    torch.manual_seed(0)
    # A real optimizer on a sharded parameter: its moments are DTensors too.
    param = torch.nn.Parameter(distribute_tensor(torch.randn(8, 4), mesh, [Shard(0)]))
    optimizer = torch.optim.AdamW([param])
    param.sum().backward()
    optimizer.step()
    assert isinstance(optimizer.state[param]["exp_avg"], DTensor)
    # What rank 0 of two holds for a (16, 4) parameter sharded on dim 0: an (8, 4) shard.
    local = torch.zeros(8, 4)
    half_of_global = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=(16, 4), stride=(4, 1))
    assert half_of_global.shape == (16, 4) and half_of_global.to_local().shape == (8, 4)
    optimizer.state[param]["rank_shard"] = half_of_global

    measured = measure_recording_ops(optimizer)

    assert measured.bytes_by_key == {"step": STEP_BYTES, "exp_avg": 32 * 4, "exp_avg_sq": 32 * 4, "rank_shard": 32 * 4}
    assert measured.num_bytes == 4 + 3 * 128 == 388
    assert measured.num_elements == 1 + 3 * 32
    assert half_of_global.numel() * half_of_global.element_size() == 256  # the global figure, not held


# -- odd values in a state ---------------------------------------------------------------------


class Projector:
    """Like GaLore's projector: tensors as attributes of a plain object."""

    def __init__(self) -> None:
        self.rank = 2
        self.ortho_matrix = torch.zeros(3, 2)
        self.owner = self  # a cycle through an object


class OddStateOptimizer(torch.optim.Optimizer):
    """Fills the first parameter's state with every kind of value a state may hold."""

    def __init__(self, params: Any) -> None:
        super().__init__(params, {"lr": 0.1})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        first, second = self.param_groups[0]["params"]
        buffer = torch.zeros(10)
        looping_list: List[Any] = [torch.zeros(3)]
        looping_list.append(looping_list)
        looping_dict: Dict[str, Any] = {"tensor": torch.zeros(2, dtype=torch.bfloat16)}
        looping_dict["self"] = looping_dict
        self.state[first].update(
            {
                "nothing": None,
                "name": "odd",
                "count": 3,
                "scale": 0.5,
                "flag": True,
                "nested": {"a": torch.zeros(2, 3), "b": [torch.zeros(4, dtype=torch.int64), {"c": torch.zeros(5, dtype=torch.float16)}]},
                "pair": (torch.zeros(2, dtype=torch.float64), 7),
                "projector": Projector(),
                "meta": torch.empty(100, device="meta"),
                "looping_list": looping_list,
                "looping_dict": looping_dict,
                "buffer": buffer,
                "view": buffer[2:5],  # shares the buffer's storage
                "slice_of_larger": torch.zeros(25)[:2],  # keeps all 25 values alive
            }
        )
        self.state[second].update({"step": 0, "note": "no tensor here"})


def test_odd_state_values_exact() -> None:
    first = torch.nn.Parameter(torch.zeros(2))
    second = torch.nn.Parameter(torch.zeros(2))
    optimizer = OddStateOptimizer([first, second])
    optimizer.step()

    measured = measure_recording_ops(optimizer)

    assert measured.bytes_by_key == {
        "nested": 6 * 4 + 4 * 8 + 5 * 2,
        "pair": 2 * 8,
        "projector": 6 * 4,
        "looping_list": 3 * 4,
        "looping_dict": 2 * 2,
        "buffer": 10 * 4,
        "slice_of_larger": 25 * 4,
    }  # no "view" (already counted with "buffer"), no "meta" (no memory)
    assert measured.num_bytes == 66 + 16 + 24 + 12 + 4 + 40 + 100 == 262
    assert measured.num_elements == (6 + 4 + 5) + 2 + 6 + 3 + 2 + 10 + 25 == 63
    assert measured.num_tensors == 9
    assert measured.num_params_with_state == 1  # the second parameter's state holds no tensor
    assert measured.bytes_by_dtype == {"float32": 24 + 24 + 12 + 40 + 100, "int64": 32, "float16": 10, "float64": 16, "bfloat16": 4}


# -- the package's own examples run ------------------------------------------------------------

DOCUMENTED_MODULES = ["trainer_memcb.state.measure", "trainer_memcb.state.estimate", "trainer_memcb.utils.units", "trainer_memcb.training.callback",
                     "trainer_memcb.state.registry"]


def package_modules() -> List[str]:
    return sorted(
        info.name for info in pkgutil.walk_packages(trainer_memcb.__path__, prefix="trainer_memcb.")
    )


@pytest.mark.parametrize("module_name", package_modules())
def test_docstring_examples_run(module_name: str) -> None:
    if module_name == "trainer_memcb.training.activations_probe":
        from trainer_memcb.training.activations_probe import ACTIVATIONS_SUPPORTED

        if not ACTIVATIONS_SUPPORTED:
            pytest.skip("its example measures activations, which this torch cannot (torch 2.8 and newer can)")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:  # a module for an optional library that is not installed
        pytest.skip(f"{module_name} needs {error.name}")
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS, report=True)
    assert result.failed == 0
    if module_name in DOCUMENTED_MODULES:
        assert result.attempted > 0
