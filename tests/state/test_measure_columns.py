"""The column-by-column reading of a common state gives exactly what the general count gives: the
same figures and every breakdown in the same order. It is taken for the states it is made for
(otherwise the speed it buys is lost without a sign) and declines every other state, which the
general count, tested exactly in test_measure.py, then measures."""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

import pytest
import torch

from trainer_memcb import measure_optimizer_state
from trainer_memcb.state.measure import _all_states, _count, _count_columns, _state_tensors


def general_count(optimizer: Any) -> Dict[str, Any]:
    return _count(_state_tensors(_all_states(optimizer))).to_dict()


def ordered(figures: Dict[str, Any]) -> List[Tuple[str, Any]]:
    """The figures with each breakdown as a list of pairs, so that comparing also compares order."""
    return [(name, list(value.items()) if isinstance(value, dict) else value) for name, value in figures.items()]


def column_count(optimizer: Any) -> Any:
    measured = _count_columns(_all_states(optimizer))
    return None if measured is None else measured.to_dict()


def stepped(optimizer: Any, params: List[torch.Tensor], steps: int = 2) -> Any:
    for _ in range(steps):
        optimizer.zero_grad()
        sum(param.float().sum() for param in params).backward()
        optimizer.step()
    return optimizer


def linear_params(dtype: torch.dtype = torch.float32) -> List[torch.nn.Parameter]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3)).to(dtype)
    return list(model.parameters())


def torch_optimizer(name: str) -> Any:
    params = linear_params()
    build = {
        "AdamW": lambda: torch.optim.AdamW(params),
        "AdamW-amsgrad": lambda: torch.optim.AdamW(params, amsgrad=True),
        "AdamW-fused": lambda: torch.optim.AdamW(params, fused=True),
        "Adam-foreach": lambda: torch.optim.Adam(params, foreach=True),
        "SGD-momentum": lambda: torch.optim.SGD(params, lr=0.1, momentum=0.9),
        "Adagrad": lambda: torch.optim.Adagrad(params),
        "RMSprop": lambda: torch.optim.RMSprop(params, momentum=0.9),
        "Adafactor": lambda: torch.optim.Adafactor(params),
    }[name]
    return stepped(build(), params)


@pytest.mark.parametrize(
    "name", ["AdamW", "AdamW-amsgrad", "AdamW-fused", "Adam-foreach", "SGD-momentum", "Adagrad", "RMSprop"])
def test_columns_read_common_torch_states_exactly(name: str) -> None:
    optimizer = torch_optimizer(name)
    by_columns = column_count(optimizer)
    assert by_columns is not None  # the common case takes the column path
    assert ordered(by_columns) == ordered(general_count(optimizer))
    assert ordered(measure_optimizer_state(optimizer).to_dict()) == ordered(by_columns)


def test_adamw_figures_by_columns_exact() -> None:
    # Linear(6, 5) and Linear(5, 3): 30 + 5 + 15 + 3 = 53 values in 4 tensors.
    measured = column_count(torch_optimizer("AdamW"))
    assert measured == {
        "num_bytes": 2 * 53 * 4 + 4 * 4,
        "num_elements": 2 * 53 + 4,
        "num_tensors": 12,
        "num_params_with_state": 4,
        "bytes_by_key": {"step": 16, "exp_avg": 212, "exp_avg_sq": 212},
        "bytes_by_dtype": {"float32": 440},
        "bytes_by_device": {"cpu": 440},
        "elements_by_key": {"step": 4, "exp_avg": 53, "exp_avg_sq": 53},
    }


def test_adafactor_two_layouts_by_columns() -> None:
    # torch's Adafactor keeps row and column factors for matrices and a full variance for vectors:
    # two groups of states with different keys, each read by columns.
    optimizer = torch_optimizer("Adafactor")
    by_columns = column_count(optimizer)
    assert by_columns is not None
    assert ordered(by_columns) == ordered(general_count(optimizer))
    assert ordered(measure_optimizer_state(optimizer).to_dict()) == ordered(by_columns)


def test_grokadamw_state_read_by_columns() -> None:
    grokadamw = pytest.importorskip("grokadamw")
    params = linear_params()
    optimizer = stepped(grokadamw.GrokAdamW(params, lr=1e-3), params)
    by_columns = column_count(optimizer)
    assert by_columns is not None  # its `step` is a plain int: a column passed over
    assert ordered(by_columns) == ordered(general_count(optimizer))
    assert by_columns["bytes_by_key"] == {"exp_avg": 212, "exp_avg_sq": 212, "grok_ema": 212}


def test_bitsandbytes_states_by_columns() -> None:
    bnb = pytest.importorskip("bitsandbytes")
    torch.manual_seed(0)
    big = torch.nn.Parameter(torch.randn(64, 128))  # 8-bit state, with the shared qmaps
    small = torch.nn.Parameter(torch.randn(10))  # 32-bit state
    eight_bit = stepped(bnb.optim.AdamW8bit([big, small]), [big, small])
    # Two layouts, and the qmaps held by the 8-bit state and again in `name2qmap`: counted once.
    by_columns = column_count(eight_bit)
    assert by_columns is not None
    assert ordered(by_columns) == ordered(general_count(eight_bit))
    assert by_columns["bytes_by_key"]["qmap1"] == by_columns["bytes_by_key"]["qmap2"] == 256 * 4
    assert by_columns["num_params_with_state"] == 2
    assert ordered(measure_optimizer_state(eight_bit).to_dict()) == ordered(by_columns)
    params = linear_params()
    full = stepped(bnb.optim.AdamW(params), params)
    by_columns = column_count(full)
    if by_columns is not None:
        assert ordered(by_columns) == ordered(general_count(full))
    assert ordered(measure_optimizer_state(full).to_dict()) == ordered(general_count(full))


class HandMadeState(torch.optim.Optimizer):
    """An optimizer whose `step` puts a given state in place, for states no library makes."""

    def __init__(self, params: List[torch.Tensor], states: List[Dict[Any, Any]]) -> None:
        super().__init__(params, {})
        self.states = states

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for param, state in zip(self.param_groups[0]["params"], self.states):
            self.state[param] = state


def with_states(*states: Dict[Any, Any]) -> HandMadeState:
    params = [torch.nn.Parameter(torch.zeros(2)) for _ in states]
    optimizer = HandMadeState(params, list(states))
    optimizer.step()
    return optimizer


def odd_bytes(num_bytes: int, dtype: torch.dtype) -> torch.Tensor:
    """A tensor of `dtype` over a storage of `num_bytes`, not a whole number of its elements."""
    storage = torch.UntypedStorage(num_bytes)
    return torch.empty(0, dtype=dtype).set_(storage, 0, (num_bytes // dtype.itemsize,))


SHARED = torch.zeros(8)
ONE = torch.zeros(5)  # one tensor, held by several states (as bitsandbytes' quantization maps are)

ODD_STATES = {
    # Read by columns: same keys in another order, plain numbers beside tensors, odd storage sizes.
    "keys in another order": ({"a": torch.zeros(3), "b": torch.ones(2, dtype=torch.float64)},
                              {"b": torch.ones(5, dtype=torch.float64), "a": torch.zeros(4)}),
    "numbers beside tensors": ({"step": 3, "m": torch.zeros(3), "note": None},
                               {"step": 4, "m": torch.zeros(5), "note": None}),
    "storages of odd sizes": ({"m": odd_bytes(10, torch.float32)}, {"m": odd_bytes(7, torch.float32)}),
    "a key not in every state": ({"m": torch.zeros(3)}, {"v": torch.zeros(3)}),
    "a key fewer": ({"m": torch.zeros(3), "v": torch.zeros(3)}, {"m": torch.zeros(3)}),
    "one tensor in every state": ({"m": torch.zeros(3), "q": ONE}, {"m": torch.zeros(4), "q": ONE}),
    "one tensor in two layouts": ({"m": torch.zeros(3), "q": ONE}, {"m": torch.zeros(4), "q": ONE},
                                  {"m": torch.zeros(2)}, {"q": ONE}),
    "one tensor, states between": ({"q": ONE}, {"m": torch.zeros(2)}, {"q": ONE}),
    "one tensor under two keys": ({"m": torch.zeros(3), "q": ONE}, {"m": torch.zeros(4), "p": ONE}),
    # Declined: each of these is the general count's to sort out.
    "one storage twice": ({"m": SHARED[:4]}, {"m": SHARED[4:]}),
    "empty storages": ({"m": torch.zeros(0)}, {"m": torch.zeros(0)}),
    "meta tensors": ({"m": torch.zeros(3, device="meta")}, {"m": torch.zeros(3, device="meta")}),
    "mixed dtypes in a key": ({"m": torch.zeros(3)}, {"m": torch.zeros(3, dtype=torch.bfloat16)}),
    "a key that is not a string": ({0: torch.zeros(3)}, {0: torch.zeros(3)}),
    "a tensor or None": ({"m": torch.zeros(3)}, {"m": None}),
    "a Parameter": ({"m": torch.nn.Parameter(torch.zeros(3))}, {"m": torch.nn.Parameter(torch.zeros(3))}),
    "a nested list": ({"m": [torch.zeros(3)]}, {"m": [torch.zeros(3)]}),
    "a sparse tensor": ({"m": torch.zeros(4, 4).to_sparse()}, {"m": torch.zeros(4, 4).to_sparse()}),
    "no tensor at all": ({"step": 1}, {"step": 2}),
    "empty states": ({}, {}),
}
READ_BY_COLUMNS = {
    "keys in another order", "numbers beside tensors", "storages of odd sizes", "a key not in every state", "a key fewer",
    "one tensor in every state", "one tensor in two layouts", "one tensor, states between", "one tensor under two keys",
}


@pytest.mark.parametrize("name", list(ODD_STATES))
def test_odd_states_by_columns_exact_or_declined(name: str) -> None:
    optimizer = with_states(*ODD_STATES[name])
    by_columns = column_count(optimizer)
    if name in READ_BY_COLUMNS:
        assert by_columns is not None
        assert ordered(by_columns) == ordered(general_count(optimizer))
    else:
        assert by_columns is None
    assert ordered(measure_optimizer_state(optimizer).to_dict()) == ordered(
        by_columns if by_columns is not None else measure_general(optimizer))


def measure_general(optimizer: Any) -> Dict[str, Any]:
    """The general count with its sparse fallback, as `measure_optimizer_state` runs it."""
    try:
        return general_count(optimizer)
    except (NotImplementedError, RuntimeError):
        from trainer_memcb.state.measure import _with_sparse_components

        return _count(_with_sparse_components(_state_tensors(_all_states(optimizer)))).to_dict()


def test_odd_storage_sizes_count_whole_elements() -> None:
    # 10 bytes hold two whole float32 values, 7 bytes one: 3, not 17 // 4 = 4.
    measured = column_count(with_states(*ODD_STATES["storages of odd sizes"]))
    assert measured["num_bytes"] == 17
    assert measured["num_elements"] == 3
    assert measured["elements_by_key"] == {"m": 3}


def test_keys_in_another_order_keep_the_first_states_order() -> None:
    measured = column_count(with_states(*ODD_STATES["keys in another order"]))
    assert list(measured["bytes_by_key"]) == ["a", "b"]
    assert list(measured["bytes_by_dtype"]) == ["float32", "float64"]
    assert measured["bytes_by_key"] == {"a": 7 * 4, "b": 7 * 8}


def test_one_tensor_held_by_several_states_counts_once() -> None:
    # 3 + 4 + 2 values of float32, and ONE's 5 once; the last state holds nothing not counted before.
    measured = column_count(with_states(*ODD_STATES["one tensor in two layouts"]))
    assert measured["bytes_by_key"] == {"m": 9 * 4, "q": 5 * 4}
    assert measured["num_tensors"] == 4
    assert measured["num_params_with_state"] == 3
    assert column_count(with_states(*ODD_STATES["one tensor, states between"]))["num_params_with_state"] == 2
    under_two_keys = column_count(with_states(*ODD_STATES["one tensor under two keys"]))
    assert under_two_keys["bytes_by_key"] == {"m": 7 * 4, "q": 5 * 4}  # counted where met first
