"""Figures across processes, from real jobs of two processes on the CPU (gloo).

Each job is `python -m torch.distributed.run --standalone --nproc_per_node 2` on a script in
`tests/dist_scripts/`, launched with a timeout, so that a hang fails the test instead of blocking
the suite; each process writes one JSON file whose exact numbers the tests assert. One launch runs
several scenarios where it can, since starting two Python processes costs more than the training.
The tests that read a job are marked `slow` (a job takes 20 to 90 s here): `.ci/run` runs them.
"""

from __future__ import annotations

import doctest
import json
import os
import subprocess
import sys
from types import SimpleNamespace
from typing import Any, Dict, List

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import trainer_memcb.training.distributed
import trainer_memcb.state.rules.deepspeed_zero
from helpers import requires_torch, tiny_classifier
from trainer_memcb import estimate_optimizer_state
from trainer_memcb.training.distributed import reduce_across_processes, world_size
from trainer_memcb.training.monitor import OptimizerStateMonitor
from trainer_memcb.training.tensorboard_view import EVENT_FILE_SUFFIX
from trainer_memcb.training.figures import (
    UNEXPECTED_BYTES,
    ESTIMATE_BYTES,
    ESTIMATE_TOTAL_BYTES,
    MASTER_WEIGHTS_BYTES,
    MEASURED_BYTES,
    MEASURED_ELEMENTS,
    MEASURED_TOTAL_BYTES,
    TRAINABLE_PARAMS,
)

TESTS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS_DIR = os.path.join(TESTS_DIR, "dist_scripts")
REPO_ROOT = os.path.dirname(TESTS_DIR)
PROCESSES = 2
# Far above what a job takes here (20 to 50 s), far below "forever".
LAUNCH_TIMEOUT_S = 180


def torchrun(script: str, out_dir: str) -> None:
    """Run `script` in `PROCESSES` processes; fail with its output if it fails or hangs."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO_ROOT, env.get("PYTHONPATH")]))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={PROCESSES}",
               os.path.join(SCRIPTS_DIR, script), out_dir]
    try:
        done = subprocess.run(command, env=env, cwd=out_dir, capture_output=True, text=True,
                              timeout=LAUNCH_TIMEOUT_S)
    except subprocess.TimeoutExpired as expired:
        output = (expired.stdout or b"")[-4000:], (expired.stderr or b"")[-4000:]
        pytest.fail(f"{script} still running after {LAUNCH_TIMEOUT_S} s (a hang?):\n{output}")
    assert done.returncode == 0, f"{script} failed:\n{done.stdout[-4000:]}\n{done.stderr[-8000:]}"


def per_process(out_dir: str) -> List[Dict[str, Any]]:
    results = []
    for rank in range(PROCESSES):
        with open(os.path.join(out_dir, f"rank{rank}.json"), encoding="utf-8") as handle:
            results.append(json.load(handle))
    return results


def figures_in(entry: Dict[str, Any], prefix: str = "") -> Dict[str, Any]:
    return {key[len(prefix):]: value for key, value in entry.items()
            if key.startswith(f"{prefix}optimizer_")}


def adamw_state_bytes(num_values: int, num_tensors: int) -> int:
    """torch AdamW: exp_avg and exp_avg_sq in fp32, plus a 0-dim fp32 `step`, per tensor."""
    return 8 * num_values + 4 * num_tensors


# -- one process: nothing exchanged ---------------------------------------------------------------


def test_one_process_exchanges_nothing_and_logs_no_totals():
    # With one process a total would only repeat its per-process figure: it is left out.
    assert not torch.distributed.is_initialized() and world_size() == 1
    own = {MEASURED_BYTES: 88, MEASURED_ELEMENTS: 22, f"{MEASURED_BYTES}/by_key/exp_avg": 40,
           ESTIMATE_BYTES: 88, TRAINABLE_PARAMS: 10, MASTER_WEIGHTS_BYTES: 40}
    reduced = reduce_across_processes(own)
    assert reduced == own and reduced is not own
    assert MEASURED_TOTAL_BYTES not in reduced and ESTIMATE_TOTAL_BYTES not in reduced
    assert reduce_across_processes({ESTIMATE_BYTES: 88}) == {ESTIMATE_BYTES: 88}
    assert reduce_across_processes({}) == {}


@pytest.mark.parametrize("module", [trainer_memcb.training.distributed, trainer_memcb.state.rules.deepspeed_zero])
def test_docstring_examples_run(module):
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.attempted >= 1 and result.failed == 0


# -- DDP through the Trainer ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def ddp_job(tmp_path_factory):
    out_dir = str(tmp_path_factory.mktemp("ddp"))
    torchrun("ddp_trainer.py", out_dir)
    return out_dir


def tiny_classifier_adamw() -> Dict[str, int]:
    model = tiny_classifier()
    params = [param for param in model.parameters() if param.requires_grad]
    num_values = sum(param.numel() for param in params)
    return {"values": num_values, "tensors": len(params), "bytes": adamw_state_bytes(num_values, len(params))}


@pytest.mark.slow
def test_ddp_trainer_logs_the_replica_and_twice_it_as_total_on_rank_zero_only(ddp_job):
    adamw = tiny_classifier_adamw()
    assert (adamw["values"], adamw["tensors"], adamw["bytes"]) == (3_714, 24, 29_808)
    expected = {
        MEASURED_BYTES: 29_808, MEASURED_TOTAL_BYTES: 2 * 29_808, MEASURED_ELEMENTS: 2 * 3_714 + 24,
        ESTIMATE_BYTES: 29_808, ESTIMATE_TOTAL_BYTES: 2 * 29_808, TRAINABLE_PARAMS: 3_714,
        UNEXPECTED_BYTES: 0,  # the main process's own measured - estimate
    }
    main, other = per_process(os.path.join(ddp_job, "replicas"))
    for rank, result in enumerate((main, other)):
        assert result["world_size"] == PROCESSES and result["is_world_process_zero"] == (rank == 0)
        assert result["model_is_ddp"] == "DistributedDataParallel"
        assert result["global_step"] == 3 and result["warnings"] == []
        # Every process holds a full replica, exactly as estimated.
        assert result["own_measured_bytes"] == result["own_estimate_bytes"] == 29_808

    training = [entry for entry in main["log_history"] if "loss" in entry]
    assert [entry["step"] for entry in training] == [1, 2, 3]
    assert all(figures_in(entry) == expected for entry in training)
    (evaluation,) = [entry for entry in main["log_history"] if "eval_loss" in entry]
    assert figures_in(evaluation, "eval_") == expected
    assert figures_in(main["evaluate_returned"], "eval_") == expected
    # The other process logs the same entries, without a single figure.
    assert len(other["log_history"]) == len(main["log_history"])
    assert not any(key.startswith(("optimizer_", "eval_optimizer_")) for entry in other["log_history"] for key in entry)

    with open(os.path.join(ddp_job, "replicas", "optimizer_memory.json"), encoding="utf-8") as handle:
        summary = json.load(handle)
    assert figures_in(summary["final_figures"]) == expected
    assert summary["measured"]["num_bytes"] == 29_808  # the main process's own


@pytest.mark.slow
def test_ddp_a_process_whose_measurement_raises_leaves_the_measured_figures_out_without_a_hang(ddp_job):
    # The launcher's timeout is the proof that nobody waited forever: the job ended by itself.
    main, failing = per_process(os.path.join(ddp_job, "failing_rank"))
    assert main["global_step"] == failing["global_step"] == 3
    assert failing["own_measured_bytes"] is None  # measuring its state raises
    assert main["own_measured_bytes"] == 29_808
    (warning,) = failing["warnings"]
    assert warning.startswith("trainer_memcb: measuring the optimizer state failed")
    assert main["warnings"] == []
    # The figure one process lacks is left out for all; the estimate, known everywhere, stays.
    estimate_only = {ESTIMATE_BYTES: 29_808, ESTIMATE_TOTAL_BYTES: 2 * 29_808, TRAINABLE_PARAMS: 3_714}
    training = [entry for entry in main["log_history"] if "loss" in entry]
    assert len(training) == 3 and all(figures_in(entry) == estimate_only for entry in training)
    (evaluation,) = [entry for entry in main["log_history"] if "eval_loss" in entry]
    assert figures_in(evaluation, "eval_") == estimate_only


# -- FSDP2 in a custom loop -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def fsdp2_job(tmp_path_factory):
    out_dir = str(tmp_path_factory.mktemp("fsdp2"))
    torchrun("fsdp2_loop.py", out_dir)
    return out_dir


def tensorboard_scalars(log_dir: str) -> Dict[str, List]:
    events = EventAccumulator(log_dir, size_guidance={"scalars": 0})
    events.Reload()
    return {tag: [(event.step, event.value) for event in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


@requires_torch("2.7", "FSDP2 on the CPU: it records events on the CPU stream, and torch.cpu.Stream has "
                      "no record_event before 2.7")
@pytest.mark.slow
def test_fsdp2_each_process_holds_its_uneven_shard_and_the_total_is_the_unsharded_state(fsdp2_job):
    results = per_process(fsdp2_job)
    # Shard(0) of 7 rows over 2 processes: ceil(7 / 2) = 4 on the first, the 3 left on the last.
    shards = [
        {"0.weight": [4, 4], "0.bias": [4], "2.weight": [2, 7], "2.bias": [2]},
        {"0.weight": [3, 4], "0.bias": [3], "2.weight": [1, 7], "2.bias": [1]},
    ]
    for result, shard in zip(results, shards):
        assert result["backend"] == "gloo" and result["warnings"] == []
        assert set(result["param_types"].values()) == {"DTensor"}
        assert result["local_shapes"] == shard
        num_values = sum(torch.Size(shape).numel() for shape in shard.values())
        own = adamw_state_bytes(num_values, num_tensors=4)
        assert result["own_measured_bytes"] == result["own_estimate_bytes"] == own
        assert result["own_trainable_params"] == num_values
        # The state is made like the local shard: a DTensor of the global shape holding the shard.
        assert result["state_shapes"]["0.weight"]["exp_avg"] == [[7, 4], "DTensor", shard["0.weight"]]
        assert result["state_shapes"]["0.weight"]["step"] == [[], "Tensor", []]
    assert [result["own_measured_bytes"] for result in results] == [304, 200]

    unsharded = torch.nn.Sequential(torch.nn.Linear(4, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3))
    unsharded_estimate = estimate_optimizer_state(torch.optim.AdamW(unsharded.parameters())).num_bytes
    assert unsharded_estimate == adamw_state_bytes(28 + 7 + 21 + 3, 4) == 488
    # Sharding splits the buffers; each process keeps its own 4-byte `step` per parameter tensor.
    total = unsharded_estimate + (PROCESSES - 1) * 4 * 4
    recipe = {MEASURED_BYTES: 304, MEASURED_TOTAL_BYTES: total, MEASURED_ELEMENTS: 2 * 36 + 4,
              ESTIMATE_BYTES: 304, ESTIMATE_TOTAL_BYTES: total, TRAINABLE_PARAMS: 36}
    expected = {**recipe, UNEXPECTED_BYTES: 0}  # the logger also judges: each process's shard as estimated
    assert total == 504
    for result in results:  # every process gets the job's figures back
        before, *after_steps = result["figures_per_step"]
        assert before == {ESTIMATE_BYTES: 304, ESTIMATE_TOTAL_BYTES: total, TRAINABLE_PARAMS: 36}
        assert after_steps == [expected, expected]
        assert result["readme_recipe"] == recipe  # the same, from the functions alone

    # Only the main process logs: one TensorBoard run, holding the job's figures at steps 1 and 2,
    # and one file of the logger's charts beside the tracker's (trainer_memcb.training.tensorboard_view).
    run = os.path.join(fsdp2_job, "fsdp2")
    assert sorted(name.endswith(EVENT_FILE_SUFFIX) for name in os.listdir(run)) == [False, True]
    scalars = tensorboard_scalars(run)
    assert scalars == {key: [(1, float(value)), (2, float(value))] for key, value in expected.items()}


# -- DeepSpeed ZeRO -------------------------------------------------------------------------------


def test_zero_partition_arithmetic_matches_hand_computed_partitions():
    zero = trainer_memcb.state.rules.deepspeed_zero
    # ZeRO-1/2: the group's values padded to a multiple of 2 x world size, then split evenly.
    assert zero.zero12_partition_numel([35, 21], world_size=2) == 28  # 56 is a multiple of 4
    assert zero.zero12_partition_numel([7, 3], world_size=2) == 6  # 10 -> 12
    assert zero.zero12_partition_numel([7, 3], world_size=4) == 4  # 10 -> 16
    assert zero.zero12_partition_numel([7, 3], world_size=1) == 10  # one process holds it all
    # With parameter_alignment every parameter but the last starts 16 bytes on: 8 bf16 values.
    assert zero.zero12_partition_numel([35, 21], 2, element_size=2, parameter_alignment=True) == 32  # 40 + 21 -> 64
    assert zero.zero12_partition_numel([35, 21], 2, element_size=4, parameter_alignment=True) == 30  # 36 + 21 -> 60
    assert zero.zero12_partition_numel([], world_size=2) == 0
    # ZeRO-3: ceil(numel / world size) of each parameter, concatenated per sub-group.
    assert [zero.zero3_partition_numel(numel, 2) for numel in (35, 21, 7, 3)] == [18, 11, 4, 2]
    assert zero.zero3_sub_group_numels([35, 21], world_size=2) == [29]
    assert zero.zero3_sub_group_numels([35, 21, 7, 3], world_size=2, sub_group_size=20) == [29, 6]
    # Partitions 12, 7, 3, 1: a sub-group closes once it reaches 12 values, the last one wherever it is.
    assert zero.zero3_sub_group_numels([35, 21, 7, 3], world_size=3, sub_group_size=12) == [12, 11]


class ZeroOptimizerStandIn:
    """Shaped like a DeepSpeed ZeRO optimizer, by the attributes `rules/deepspeed_zero.py` reads.

    They check the bookkeeping without starting processes; `test_deepspeed_zero_engines` runs
    DeepSpeed's own engines on the CPU.
    """

    def __init__(self, inner: torch.optim.Optimizer, **attributes: Any) -> None:
        self.optimizer = inner
        self.__dict__.update(attributes)

    @property
    def param_groups(self) -> List[Dict[str, Any]]:  # ZeRO's optimizers pass on the inner one's
        return self.optimizer.param_groups


class Wrapper:
    """Like accelerate's `DeepSpeedOptimizerWrapper`: the real optimizer behind `.optimizer`."""

    def __init__(self, optimizer: Any) -> None:
        self.optimizer = optimizer

    @property
    def param_groups(self) -> List[Dict[str, Any]]:
        return self.optimizer.param_groups


def stepped_adamw(partitions: List[List[torch.Tensor]]) -> torch.optim.AdamW:
    inner = torch.optim.AdamW([{"params": group} for group in partitions], lr=1e-3)
    for group in partitions:
        for partition in group:
            partition.grad = torch.ones_like(partition)
    inner.step()
    return inner


def test_master_weights_and_the_lent_zero3_partitions_on_stand_ins():
    zero = trainer_memcb.state.rules.deepspeed_zero
    assert zero.master_weights_bytes(torch.optim.AdamW(torch.nn.Linear(2, 2).parameters())) is None

    # ZeRO-1/2: fp32 copies of this rank's partitions, one per group, the inner optimizer's params.
    bit16 = [torch.zeros(56, dtype=torch.bfloat16), torch.zeros(12, dtype=torch.bfloat16)]
    masters = [torch.zeros(28, requires_grad=True), torch.zeros(6, requires_grad=True)]
    stage12 = Wrapper(ZeroOptimizerStandIn(stepped_adamw([[masters[0]], [masters[1]]]),
                                   single_partition_of_fp32_groups=masters, bit16_groups_flat=bit16,
                                   partition_gradients=True))
    assert zero.master_weights_bytes(stage12) == 4 * 34
    assert zero.find_zero_optimizer(stage12)[3] == 2
    assert zero.with_zero3_partitions(stage12) is stage12
    assert estimate_optimizer_state(stage12).num_bytes == adamw_state_bytes(34, 2) == 280

    # ZeRO-3: one sub-group reuses the model's own fp32 partition (no copy), one is a copy; the
    # inner optimizer's groups are empty outside its step, as DeepSpeed leaves them.
    model_partitions = [torch.zeros(29, requires_grad=True), torch.zeros(6, dtype=torch.bfloat16)]
    copies = [model_partitions[0], torch.zeros(6, requires_grad=True)]
    inner = stepped_adamw([[copies[0]], [copies[1]]])
    for group in inner.param_groups:
        group["params"] = []
    stage3 = Wrapper(ZeroOptimizerStandIn(inner, fp32_partitioned_groups_flat=copies,
                                  fp16_partitioned_groups_flat=model_partitions, sub_group_to_group_id={0: 0, 1: 1}))
    assert zero.master_weights_bytes(stage3) == 4 * 6
    lent = zero.with_zero3_partitions(stage3)
    assert type(lent) is torch.optim.AdamW and lent.state is inner.state
    assert [group["params"] for group in lent.param_groups] == [[copies[0]], [copies[1]]]
    assert [group["params"] for group in inner.param_groups] == [[], []]  # the real one untouched
    assert lent.param_groups[0]["lr"] == inner.param_groups[0]["lr"] == 1e-3
    assert estimate_optimizer_state(lent).num_bytes == adamw_state_bytes(35, 2) == 288
    assert estimate_optimizer_state(stage3).num_bytes == 288  # the public function lends them itself

    # Through the monitor (the callback's and the loop logger's core), one process: the master
    # weights are a figure of their own beside the state.
    for optimizer, state_bytes, master_bytes in ((stage12, 280, 4 * 34), (stage3, 288, 4 * 6)):
        monitor = OptimizerStateMonitor()
        monitor.attach(optimizer)
        figures = monitor.figures(step=1)
        assert figures[MEASURED_BYTES] == figures[ESTIMATE_BYTES] == state_bytes
        assert figures[MASTER_WEIGHTS_BYTES] == master_bytes
    plain = OptimizerStateMonitor()
    plain.attach(stepped_adamw([[torch.zeros(3, requires_grad=True)]]))
    assert MASTER_WEIGHTS_BYTES not in plain.figures(step=1)


def test_deepspeed_optimizer_rules_follow_their_source():
    from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam

    from trainer_memcb.state.estimate import ParamInfo, find_estimate_rule

    info = ParamInfo(shape=(34,), dtype=torch.bfloat16, requires_grad=True, group_index=0, index_in_group=0)
    fused, cpu = find_estimate_rule(FusedAdam), find_estimate_rule(DeepSpeedCPUAdam)
    assert fused.per_param(info, {}, None) == {"exp_avg": 68, "exp_avg_sq": 68}  # like the partition
    fp32_states, own_dtype = SimpleNamespace(fp32_optimizer_states=True), SimpleNamespace(fp32_optimizer_states=False)
    assert cpu.per_param(info, {}, fp32_states) == {"exp_avg": 136, "exp_avg_sq": 136}
    assert cpu.per_param(info, {}, own_dtype) == {"exp_avg": 68, "exp_avg_sq": 68}


# -- DeepSpeed ZeRO, run: one launch, a custom loop's runs and the Trainer's ----------------------


@pytest.fixture(scope="module")
def deepspeed_job(tmp_path_factory):
    out_dir = str(tmp_path_factory.mktemp("deepspeed"))
    torchrun("deepspeed_zero.py", out_dir)
    return out_dir


def planned_per_process(model: torch.nn.Module, sharding: str, precision: str, rank: int,
                        whole_zero_grads: bool = False) -> Dict[str, int]:
    """The plan's four model states for one process, the parameters in the Trainer's two groups."""
    from trainer_memcb.plan.answers.model_states import (
        layout_model_states, param_specs, plan_model_states, trainer_param_groups,
    )
    from trainer_memcb.plan.settings.setup import Setup

    setup = Setup(world_size=PROCESSES, sharding=sharding, precision=precision)
    layout = layout_model_states(param_specs(model, groups=trainer_param_groups(model)), setup, rank=rank,
                                 whole_zero_grads=whole_zero_grads)
    (plan,) = plan_model_states(model, "adamw_torch", setup).optimizers
    planned = {"params": layout.params_bytes, "grads": layout.grads_bytes, "masters": layout.master_weights_bytes,
               "optimizer_state": plan.optimizer_state_bytes}
    planned["model_states"] = sum(planned.values())
    return planned


def logged_figures(walks: List[Dict[str, int]], partitions: List[int]) -> Dict[str, int]:
    """What the main process logs, from each process's own walk: the largest, and the sums."""
    state, masters = walks[0]["optimizer_state"], walks[0]["masters"]
    assert all(walk["optimizer_state"] == state and walk["masters"] == masters for walk in walks)
    assert state == adamw_state_bytes(sum(partitions), num_tensors=len(partitions))
    assert masters == 4 * sum(partitions)
    states = [walk["model_states"] for walk in walks]
    return {
        MEASURED_BYTES: state, MEASURED_TOTAL_BYTES: PROCESSES * state, MEASURED_ELEMENTS: 2 * sum(partitions) + len(partitions),
        ESTIMATE_BYTES: state, ESTIMATE_TOTAL_BYTES: PROCESSES * state, TRAINABLE_PARAMS: sum(partitions),
        MASTER_WEIGHTS_BYTES: masters, UNEXPECTED_BYTES: 0,
        "model_params_bytes": max(walk["params"] for walk in walks), "model_grads_bytes": max(walk["grads"] for walk in walks),
        "model_states_bytes": max(states), "model_states_total_bytes": sum(states),
        "model_states_estimate_bytes": max(states), "model_states_estimate_total_bytes": sum(states),
    }


def loop_model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3))


@pytest.mark.slow
def test_deepspeed_zero_engines(deepspeed_job):
    zero = trainer_memcb.state.rules.deepspeed_zero
    # Weights 35 + 21 and biases 7 + 3, in two groups, over 2 processes.
    zero12 = [zero.zero12_partition_numel([35, 21], 2), zero.zero12_partition_numel([7, 3], 2)]
    zero3 = zero.zero3_sub_group_numels([35, 21], 2) + zero.zero3_sub_group_numels([7, 3], 2)
    assert (zero12, zero3) == ([28, 6], [29, 6])
    runs = {
        "zero1": ("DeepSpeedZeroOptimizer", 1, "torch.float32", zero12),
        "zero2": ("DeepSpeedZeroOptimizer", 2, "torch.float32", zero12),
        "zero2_bf16": ("DeepSpeedZeroOptimizer", 2, "torch.bfloat16", zero12),
        "zero1_bf16_fp32_accumulation": ("BF16_Optimizer", 1, "torch.bfloat16", zero12),
        "zero3": ("DeepSpeedZeroOptimizer_Stage3", 3, "torch.float32", zero3),
    }
    # The gradients each process holds when the step begins, as walked: ZeRO-1/2 hold every
    # gradient their partition touches, whole, plus padding (rank 0: the 35-value weight and the
    # 7-value bias; rank 1: all four and 2 zeros); ZeRO-3 its partitions; BF16_Optimizer all, whole.
    grads = {"zero1": [168, 272], "zero2": [168, 272], "zero2_bf16": [84, 136],
             "zero1_bf16_fp32_accumulation": [132, 132], "zero3": [140, 140]}
    for name, (zero_class, stage, model_dtype, partitions) in runs.items():
        results = per_process(os.path.join(deepspeed_job, name))
        precision = "deepspeed-bf16" if model_dtype == "torch.bfloat16" else "fp32"
        walks = [result["walks"][-1] for result in results]
        assert [walk["grads"] for walk in walks] == grads[name], name
        for rank, (result, walk) in enumerate(zip(results, walks)):
            assert (result["zero_class"], result["stage"], result["model_dtype"]) == (zero_class, stage, model_dtype), name
            assert result["master_partition_numels"] == partitions, name
            assert result["master_partition_dtypes"] == ["torch.float32"] * 2, name
            assert result["walks"][0] == walk, name  # the same at both steps
            assert walk == planned_per_process(loop_model(), f"zero{stage}", precision, rank,
                                               whole_zero_grads=zero_class == "BF16_Optimizer"), name
        expected = logged_figures(walks, partitions)
        for result in results:
            state = adamw_state_bytes(sum(partitions), num_tensors=2)
            assert result["own_measured_bytes"] == result["own_estimate_bytes"] == state, name
            figures = {key: value for key, value in expected.items() if not key.startswith("model_")}
            assert result["figures"] == figures, name
            assert result["figures_before_a_step"] == {
                key: value for key, value in expected.items()
                if key in (ESTIMATE_BYTES, ESTIMATE_TOTAL_BYTES, TRAINABLE_PARAMS, MASTER_WEIGHTS_BYTES)}, name
            # The four model states, every run measured: equal to the walk and to the plan, per process.
            assert result["model_states"] == {key: value for key, value in expected.items() if key.startswith("model_")}, name
            assert result["warnings"] == [], name
            # ZeRO-1/2's step is wrapped while the logger watches it, and given back by close().
            assert (result["step_wrapped_during_training"], result["step_wrapped_after_close"]) == (
                zero_class == "DeepSpeedZeroOptimizer", False), name
            # ZeRO-3 lends its partitions to the inner optimizer only for the step.
            assert result["inner_groups_untouched"] == ([0, 0] if stage == 3 else [1, 1]), name
    # The fp32 gradient partitions, made for one group's step at a time: 28 and 6 values. On rank 0
    # of an fp32 model the first is a view of the 16-bit buffer (168 bytes), not a copy.
    assert [result["fp32_grad_partitions"][-2:] for result in per_process(os.path.join(deepspeed_job, "zero2"))] == [
        [168, 168], [112, 24]]
    assert per_process(os.path.join(deepspeed_job, "zero2_bf16"))[0]["fp32_grad_partitions"][-2:] == [112, 24]


TRAINER_ZERO_RUNS = {f"trainer_zero{stage}{'_bf16' if bf16 else ''}": (stage, bf16) for stage in (1, 2, 3) for bf16 in (False, True)}


@pytest.mark.slow
@pytest.mark.parametrize("name", TRAINER_ZERO_RUNS)
def test_trainer_with_deepspeed_logs_every_figure_equal_to_the_walk_and_the_plan(deepspeed_job, name):
    from trainer_memcb.plan.answers.model_states import trainer_param_groups

    stage, bf16 = TRAINER_ZERO_RUNS[name]
    main, other = results = per_process(os.path.join(deepspeed_job, name))
    model = tiny_classifier()
    groups = trainer_param_groups(model)
    numels = [[param.numel() for param in model.parameters() if groups[id(param)] == group] for group in (0, 1)]
    assert [sum(group) for group in numels] == [3_488, 226]
    for result in results:  # DeepSpeed's groups are the Trainer's
        assert result["group_param_numels"] == numels and result["warnings"] == []
        assert result["zero_class"] == ("DeepSpeedZeroOptimizer_Stage3" if stage == 3 else "DeepSpeedZeroOptimizer")
        assert result["model_dtype"] == ("torch.bfloat16" if bf16 else "torch.float32")
    zero = trainer_memcb.state.rules.deepspeed_zero
    partitions = ([zero.zero12_partition_numel(group, 2) for group in numels] if stage < 3 else
                  [numel for group in numels for numel in zero.zero3_sub_group_numels(group, 2)])
    walks = [result["walks"][-1] for result in results]
    precision = "deepspeed-bf16" if bf16 else "fp32"
    for rank, (result, walk) in enumerate(zip(results, walks)):
        assert result["walks"][0] == walk
        assert walk == planned_per_process(model, f"zero{stage}", precision, rank)
    # ZeRO-1/2: rank 0's partition touches 2,048 gradient values, rank 1's 1,940 (with padding).
    element = 2 if bf16 else 4
    assert [walk["grads"] for walk in walks] == ([2_048 * element, 1_940 * element] if stage < 3 else [1_857 * element] * 2)

    expected = logged_figures(walks, partitions)
    training = [entry for entry in main["log_history"] if "loss" in entry]
    assert [entry["step"] for entry in training] == [1, 2]
    for entry in training:
        assert {key: value for key, value in entry.items() if key in expected or key.startswith(("optimizer_", "model_"))} == expected
    evaluations = [entry for entry in main["log_history"] if "eval_loss" in entry]
    assert len(evaluations) == 1
    assert {key[5:]: value for key, value in evaluations[0].items() if key[5:] in expected or key.startswith(
        ("eval_optimizer_", "eval_model_"))} == expected
    assert not any(key.startswith(("optimizer_", "model_", "eval_optimizer_", "eval_model_"))
                   for entry in other["log_history"] for key in entry)
    # ZeRO-1/2's step is wrapped while the Trainer trains, and given back at on_train_end.
    for result in results:
        assert (result["step_wrapped_during_training"], result["step_wrapped_after_training"]) == (stage < 3, False)


# -- the four model states, measured, against the plan -------------------------------------------

MODEL_STATES_KEYS = ("model_params_bytes", "model_grads_bytes", "model_states_bytes", "model_states_total_bytes",
                     "model_states_estimate_bytes", "model_states_estimate_total_bytes")


def model_states_in(entry: Dict[str, Any], prefix: str = "") -> Dict[str, Any]:
    return {key[len(prefix):]: value for key, value in entry.items() if key[len(prefix):] in MODEL_STATES_KEYS}


@pytest.mark.slow
def test_ddp_trainer_logs_model_states_equal_to_the_plan_to_the_byte(ddp_job):
    from trainer_memcb.plan.answers.model_states import plan_model_states
    from trainer_memcb.plan.settings.setup import Setup

    # The plan, from the model alone: 3,714 fp32 values whole on each of 2 processes, AdamW.
    (plan,) = plan_model_states(tiny_classifier(), "adamw", Setup(world_size=PROCESSES, sharding="ddp")).optimizers
    assert (plan.params_bytes, plan.grads_bytes, plan.optimizer_state_bytes, plan.master_weights_bytes) == (
        14_856, 14_856, 29_808, 0)
    assert plan.model_states_bytes == 59_520
    expected = {"model_params_bytes": 14_856, "model_grads_bytes": 14_856, "model_states_bytes": 59_520,
                "model_states_total_bytes": 2 * 59_520, "model_states_estimate_bytes": plan.model_states_bytes,
                "model_states_estimate_total_bytes": 2 * 59_520}
    main, other = per_process(os.path.join(ddp_job, "replicas"))
    training = [entry for entry in main["log_history"] if "loss" in entry]
    assert len(training) == 3 and all(model_states_in(entry) == expected for entry in training)
    (evaluation,) = [entry for entry in main["log_history"] if "eval_loss" in entry]
    assert model_states_in(evaluation, "eval_") == expected
    assert not any(key.startswith("model_") for entry in other["log_history"] for key in entry)
    with open(os.path.join(ddp_job, "replicas", "optimizer_memory.json"), encoding="utf-8") as handle:
        assert model_states_in(json.load(handle)["final_figures"]) == expected


@requires_torch("2.7", "FSDP2 on the CPU: it records events on the CPU stream, and torch.cpu.Stream has "
                      "no record_event before 2.7")
@pytest.mark.slow
def test_fsdp2_logs_model_states_equal_to_the_plan_to_the_byte(fsdp2_job):
    from trainer_memcb.plan.answers.model_states import plan_model_states
    from trainer_memcb.plan.settings.setup import Setup

    unsharded = torch.nn.Sequential(torch.nn.Linear(4, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3))
    (plan,) = plan_model_states(unsharded, "adamw", Setup(world_size=PROCESSES, sharding="fsdp-full-shard")).optimizers
    # Every rank's shard storage is padded to ceil(rows / 2) rows: 4x4 + 4 + 2x7 + 2 = 36 values,
    # for the parameters and for the reduce-scattered gradients alike; the first rank steps over
    # the most (its 36 values), as its optimizer state shows.
    assert (plan.params_bytes, plan.grads_bytes, plan.optimizer_state_bytes) == (144, 144, 304)
    assert plan.model_states_bytes == 592
    results = per_process(fsdp2_job)
    for result in results:
        assert result["own_params_bytes"] == result["own_grads_bytes_before_step"] == 144
    # The second rank: the same padded storages, and a state of 200 bytes (its 3 + 1 rows).
    total = 592 + (144 + 144 + 200)
    for result in results:
        for figures in result["model_states_per_step"]:
            assert model_states_in(figures) == {
                "model_params_bytes": 144, "model_grads_bytes": 144, "model_states_bytes": plan.model_states_bytes,
                "model_states_total_bytes": total, "model_states_estimate_bytes": plan.model_states_bytes,
                "model_states_estimate_total_bytes": total}


@requires_torch("2.7", "FSDP2 on the CPU: it records events on the CPU stream, and torch.cpu.Stream has "
                      "no record_event before 2.7")
@pytest.mark.slow
@pytest.mark.parametrize("mode", ["shard_grad_op", "cpu_offload"])
def test_fsdp2_shard_grad_op_and_cpu_offload_run_and_hold_what_the_plan_says(fsdp2_job, mode):
    from trainer_memcb.plan.answers.model_states import plan_model_states
    from trainer_memcb.plan.settings.setup import Setup

    unsharded = torch.nn.Sequential(torch.nn.Linear(4, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3))
    setup = Setup(world_size=PROCESSES, sharding="fsdp-shard-grad-op" if mode == "shard_grad_op" else "fsdp-full-shard",
                  offload_params=mode == "cpu_offload")
    (plan,) = plan_model_states(unsharded, "adamw", setup).optimizers
    assert (plan.params_bytes, plan.grads_bytes, plan.optimizer_state_bytes, plan.model_states_bytes) == (144, 144, 304, 592)
    total = 592 + (144 + 144 + 200)  # the second process steps over its 3 + 1 rows: 200 bytes of state
    for rank, result in enumerate(per_process(os.path.join(fsdp2_job, mode))):
        assert result["param_types"] == ["DTensor"] and result["devices"] == ["cpu"] and result["warnings"] == []
        assert result["sharded_params_bytes"] == plan.params_bytes
        # The walk, at both steps: the padded shards and their gradients, and this process's state.
        assert result["walks"] == [{"params": 144, "grads": 144, "optimizer_state": [304, 200][rank]}] * 2
        assert result["model_states_per_step"] == [{
            "model_params_bytes": 144, "model_grads_bytes": 144, "model_states_bytes": plan.model_states_bytes,
            "model_states_total_bytes": total, "model_states_estimate_bytes": plan.model_states_bytes,
            "model_states_estimate_total_bytes": total}] * 2
        if mode == "shard_grad_op":
            # Between forward and backward the layers' parameters are views of the all-gathered
            # buffers, 2 padded shards each, held beside the shards: the plan's transient figure.
            assert result["unsharded_after_forward"] == [plan.transient_bytes["unsharded_params_bytes"]] * 2 == [288] * 2
        else:  # full shard: back in their shards after forward
            assert result["unsharded_after_forward"] == [144] * 2
    if mode == "cpu_offload":  # the plan puts it all on the CPU; here the device is the CPU anyway
        assert (plan.device_bytes, plan.cpu_bytes) == (0, 592)
