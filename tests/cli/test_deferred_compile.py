"""bitsandbytes' CPU kernels compiled at their first call in the `trainer-memcb` process
(`trainer_memcb.cli.deferred_compile`): the deferral itself, and an estimate that builds the
8-bit optimizer without loading Inductor's compiler."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any, List

import pytest

from trainer_memcb.cli.deferred_compile import compiled_at_first_call

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_a_deferred_compile_runs_at_the_first_call_once_with_its_options():
    made: List[Any] = []

    def compile_(fn, **options):
        made.append(options)
        return lambda *args, **kwargs: ("compiled", fn(*args, **kwargs))

    def double(x):
        """Doubles."""
        return 2 * x

    deferred = compiled_at_first_call(compile_)
    plain, decorated = deferred(double, dynamic=True), deferred(fullgraph=True)(double)
    assert made == [] and plain.__doc__ == "Doubles." and plain.__wrapped__ is double
    assert (plain(3), plain(4)) == (("compiled", 6), ("compiled", 8))
    assert made == [{"dynamic": True}]
    assert decorated(5) == ("compiled", 10) and made == [{"dynamic": True}, {"fullgraph": True}]


def test_an_estimate_with_the_8_bit_optimizer_loads_no_inductor_compiler_and_leaves_torch_compile_its_own():
    # The default optimizers include adamw_bnb_8bit, whose class imports bitsandbytes; its CPU
    # kernels were compiled there (torch._inductor.compile_fx loaded: about 0.65 s here).
    pytest.importorskip("bitsandbytes", reason="bitsandbytes is not installed")
    code = ("import sys, json, io, contextlib\n"
            "sys.argv = ['trainer-memcb', 'estimate', 'examples/models/tiny-distilbert']\n"
            "from trainer_memcb.cli import console_main\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            "    assert console_main() == 0\n"
            "import torch\n"
            "print(json.dumps([{m: m in sys.modules for m in ('bitsandbytes.backends.default.ops',"
            " 'torch._inductor.compile_fx')}, torch.compile.__module__]))")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=REPO_ROOT))
    assert done.returncode == 0, done.stderr[-3000:]
    loaded, compile_module = json.loads(done.stdout.splitlines()[-1])
    assert loaded == {"bitsandbytes.backends.default.ops": True, "torch._inductor.compile_fx": False}
    assert compile_module == "torch"
