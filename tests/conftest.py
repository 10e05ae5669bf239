"""Suite-wide isolation for process-wide state that real libraries keep between tests."""

from __future__ import annotations

import os
import sys

import pytest


def pytest_configure(config):
    """Under pytest-xdist (`-n N`), each worker takes an equal share of the cores for torch's
    threads: N workers of torch's default (every core) would each fight the others for them."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers:
        import torch

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(workers)))


@pytest.fixture(autouse=True)
def fresh_bitsandbytes_overrides():
    """bitsandbytes keeps per-parameter overrides in a process-wide `GlobalOptimManager`, keyed by
    (group, position): a Trainer run with `optim="adamw_bnb_8bit"` leaves 32-bit overrides there
    that would apply to the first parameters of any later bitsandbytes optimizer. Start and end
    every test with an empty manager (only when bitsandbytes is already imported)."""

    def reset() -> None:
        module = sys.modules.get("bitsandbytes.optim")
        if module is not None:
            module.GlobalOptimManager.get_instance().initialize()

    reset()
    yield
    reset()


@pytest.fixture(autouse=True)
def restored_environment():
    """`TrainingArguments` of transformers 4.x writes accelerate's settings into `os.environ`
    (`ACCELERATE_MIXED_PRECISION=bf16` after `bf16=True`), and every later `Accelerator` in the
    process reads them: a Trainer of a later test would then wrap its model's forward in autocast.
    Each test ends with the environment it started with."""
    before = dict(os.environ)
    yield
    if os.environ != before:
        os.environ.clear()
        os.environ.update(before)


@pytest.fixture(autouse=True)
def forgotten_compilations():
    """On torch 2.6 a dispatch mode stops a compiled function from compiling, so the callback leaves
    the evaluation's forward unmeasured once dynamo has compiled anything in the process
    (`trainer_memcb.utils.compiled.dispatch_modes_stop_compiling`). A test that compiled ends with
    dynamo's caches and counters cleared, as a fresh process would start the next test."""
    yield
    utils = sys.modules.get("torch._dynamo.utils")
    counters = getattr(utils, "counters", None)
    if counters is not None and counters["frames"]["total"] > 0:
        import torch

        torch._dynamo.reset()
        counters.clear()


@pytest.fixture(scope="module")
def one_torch_thread():
    """For modules of many tiny optimizer steps (`pytestmark = pytest.mark.usefixtures(...)`):
    tensors this small run fastest on one thread, and many times faster on a busy machine."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture
def fresh_accelerator_state():
    """Accelerate keeps its state in process-wide singletons; a test that makes its own Accelerator
    starts and ends with none."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory):
    """The tiny Llama's config folder (`helpers.tiny_llama_folder`, its default sizes), made once
    per test module; a module that plans another config defines a fixture of this name of its own."""
    from helpers import tiny_llama_folder

    return tiny_llama_folder(tmp_path_factory, "tiny-llama")
