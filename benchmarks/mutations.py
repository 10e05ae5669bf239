"""A mutation check: small deliberate bugs in the modules that decide the figures, each run
against the tests that cover it, to find what the tests do not hold.

Each edit below replaces one piece of text in one module (the text must occur exactly once) and
names the fastest test selection that covers that behaviour. The script copies the repository
(tracked and untracked files that git does not ignore) into a temporary folder, once per job,
applies one edit at a time there, runs `python -m pytest -x -q -p no:cacheprovider <selection>` in
that copy, and restores the file. The working tree is never touched. An edit is killed when the
tests fail (or time out), and survives when they pass. Before the edits, each selection runs once
unchanged (the baseline): a selection that fails unchanged would kill every edit, so its edits are
reported as such and left out of the rate.

Edits marked `equivalent` change no behaviour a test could see (the reason is given beside them);
they are listed, not run, and not counted in the kill rate.

Usage:
    python benchmarks/mutations.py                  # every edit, one job
    python benchmarks/mutations.py --list           # the edits and their tests, nothing run
    python benchmarks/mutations.py --only judge     # the edits of modules whose path contains "judge"
    python benchmarks/mutations.py --edit state/judge.py#1 --no-baseline
    python benchmarks/mutations.py --jobs 2

Exit status: 0 when every edit run was killed, 1 when one survived (or a baseline failed), 2 for
bad arguments or an edit whose text is not found exactly once.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Sequence, Set, Tuple

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = "trainer_memcb"
PYTEST = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider"]


@dataclass(frozen=True)
class Edit:
    """One small deliberate bug.

    Attributes:
        module: the file, relative to `trainer_memcb/`.
        old, new: the text replaced (exactly once in the file) and its replacement.
        tests: pytest arguments (files or node ids) that must catch it.
        equivalent: why the edit changes nothing a test could see; None for a real bug.
    """

    module: str
    old: str
    new: str
    tests: Tuple[str, ...]
    equivalent: Optional[str] = None


# -- the fastest covering test selections ---------------------------------------------------------
ESTIMATE_RULES = "tests/state/test_estimate_rules.py"
TIED = f"{ESTIMATE_RULES}::test_a_tied_weight_listed_twice_in_a_group_counts_once"
ADAGRAD = f"{ESTIMATE_RULES}::test_adagrad_state_exists_at_construction_frozen_params_included"
JUDGE = "tests/state/test_judge.py"
JUDGE_ADAGRAD = f"{JUDGE}::test_adagrad_state_for_frozen_parameters_is_expected_and_not_flagged"
JUDGE_FAST = (
    f"{JUDGE}::test_bnb_override_after_the_estimate_gives_32bit_state_where_8bit_was_expected",
    f"{JUDGE}::test_bnb_min_8bit_size_set_at_construction_is_what_the_rule_expects",
    f"{JUDGE}::test_bf16_adamw_whose_moments_were_cast_to_fp32_holds_another_dtype_than_its_parameters",
    f"{JUDGE}::test_a_subclass_that_keeps_more_state_shows_the_key_the_rule_does_not_know",
    f"{JUDGE}::test_state_left_behind_by_a_parameter_taken_out_of_the_groups",
    JUDGE_ADAGRAD,
    f"{JUDGE}::test_no_figure_until_every_trainable_parameter_has_state",
    f"{JUDGE}::test_what_no_cause_accounts_for_is_unexplained_and_the_causes_add_up",
    f"{JUDGE}::test_docstring_example_runs",
)
# torchao's first quantized state compiles for tens of seconds: its measure tests are left to the
# torchao edit, which takes the quicker estimate-against-measure cases.
MEASURE = ("tests/state/test_measure.py", "tests/state/test_measure_columns.py", "-k", "not torchao")
TORCHAO = (ESTIMATE_RULES, "-k", "torchao")
LIBRARIES = "tests/state/test_estimate_rules_libraries.py"
# The CLI usage errors start a process each: left out where the plan's arithmetic is what is edited.
PLAN = ("tests/plan/test_plan.py", "-k", "not usage_errors")
PER_OPTIMIZER = ("tests/training/test_per_optimizer.py",
                 "tests/training/test_faults_training.py::test_an_object_without_weak_references_is_held_until_released")
MODEL_STATES = "tests/training/test_model_states.py"
LOGGING = "tests/training/test_callback_logging.py"
LIFECYCLE = "tests/training/test_callback_lifecycle.py"
TWO_TRAIN_CALLS = f"{LIFECYCLE}::test_one_callback_for_two_train_calls_then_for_a_second_trainer"
FAULTS = "tests/training/test_faults_training.py"
LOOP = "tests/training/test_accelerate_loop.py"
MONITOR = "tests/training/test_monitor.py"
# The ZeRO partition arithmetic's hand-computed cases (beside the torchrun jobs, which are not run).
ZERO_ARITHMETIC = ("tests/training/test_distributed.py::test_zero_partition_arithmetic_matches_hand_computed_partitions",)
CLOSING = f"{LOGGING}::test_the_closing_train_runtime_entry_gets_no_figures_under_any_prefix"
# The probes: the wrapper on plain modules (seconds), the contract's real Trainers (a minute each).
CONTRACT = "tests/training/test_probe_contract.py"
WRAPPER_UNITS = (CONTRACT, "-k", "wrapper_whose or left_inside or inside_another")
STALE_IN_A_LOOP = (CONTRACT, "-k", "loop")
NESTED = "tests/training/test_nested_trainers.py"
NESTED_STEP = (NESTED, "-k", "logged_step")
COMPILED_RUNS = ("tests/training/test_compiled_runs.py",)
RAISING_BACKWARD = (f"{CONTRACT}::test_a_step_that_raises_leaves_the_model_and_optimizer_as_they_were[backward]",)
FULLGRAPH = (f"{CONTRACT}::test_the_trainers_torch_compile_runs_as_without_the_callback_and_leaves_the_activations_out"
             "[fullgraph]",)
ACTIVATIONS = "tests/training/test_activations.py"
SEVERAL_FORWARDS = (f"{ACTIVATIONS}::test_several_forwards_of_one_micro_batch_are_counted_together",)
ACCUMULATION = (f"{ACTIVATIONS}::test_gradient_accumulation_reports_the_last_micro_batch",)
SAVED_TENSORS = ("tests/state/test_saved_tensors.py",)
ZERO_TAP = (f"{MODEL_STATES}::test_zero12_gradients_are_measured_when_deepspeeds_step_begins",
            f"{MODEL_STATES}::test_zero12_gradients_are_measured_when_one_of_two_owners_wants_them")
LIVE_STORAGES = ("tests/plan/test_live_storages.py",)
LAYER_FOLD = ("tests/plan/test_layer_fold.py",)
# The step plan and its command: the command run in this process (seconds a case), the Python plan.
CLI_ANSWERS = "tests/cli/test_cli_answers.py"
CLI_STEP = "tests/cli/test_cli_step.py"
STEP_ON_THE_COMMAND_LINE = (CLI_ANSWERS, CLI_STEP)
OPTIMIZER_PHASE_PEAK = ("tests/plan/test_step_memory.py::test_a_peak_in_the_optimizer_step_holds_all_of_the_state_as_every_later_step",
                        f"{CLI_ANSWERS}::test_the_step_plans_optimizer_state_is_the_model_states_tables")
UNTRACEABLE_OPTIMIZER = ("tests/plan/test_step_untraceable_optimizers.py::test_an_8bit_optimizer_is_planned_with_its_rules_state",)
SEARCH = (f"{CLI_STEP}::test_max_batch_size_finds_the_largest_batch_of_a_convex_peak",
          f"{CLI_ANSWERS}::test_a_missing_peak_is_never_read_as_does_not_fit",
          f"{CLI_ANSWERS}::test_max_batch_size_of_a_step_that_cannot_be_traced_says_so_and_why",
          f"{CLI_ANSWERS}::test_max_batch_size_exits_3_when_no_batch_fits")

FLOPS = ("tests/plan/test_flops.py",)
TP_RULES = ("tests/plan/test_tp_plan_rules.py", "-k", "not command")

EDITS: List[Edit] = [
    # -- state/estimate.py: the estimate's parameter walk and its sums --------------------------
    Edit("state/estimate.py", "if not isinstance(param, torch.Tensor) or id(param) in seen:",
         "if not isinstance(param, torch.Tensor):", (TIED,)),  # a tied weight listed twice counts twice
    Edit("state/estimate.py", "if not (info.requires_grad or rule.includes_frozen):",
         "if not info.requires_grad:", (ADAGRAD,)),  # Adagrad's state for frozen parameters left out
    Edit("state/estimate.py", "                num_param_tensors += 1", "                num_param_tensors += 2", (TIED,)),
    Edit("state/estimate.py", "            for key, num_bytes in rule.shared(inner, infos).items():\n"
         "                bytes_by_key[key] += int(num_bytes)",
         "            for key, num_bytes in rule.shared(inner, infos).items():\n"
         "                bytes_by_key[key] += 0", (f"{ESTIMATE_RULES}::test_estimate_equals_measured_state",)),
    # -- state/judge.py: which cause a difference is put down to ---------------------------------
    Edit("state/judge.py", "frozen = not requires_grad and not expectation.includes_frozen",
         "frozen = not requires_grad", (JUDGE_ADAGRAD,)),  # Adagrad's frozen state flagged
    Edit("state/judge.py", "if held.num_elements == numel and want == numel and itemsize == 4:",
         "if held.num_elements == numel and want == numel and itemsize == 2:", JUDGE_FAST),
    Edit("state/judge.py", "        return all(pid in with_state for pid in trainable)",
         "        return any(pid in with_state for pid in trainable)", JUDGE_FAST),
    Edit("state/judge.py", "            self.causes.add(kind, -want, name, None, param_dtype, id(param))",
         "            self.causes.add(kind, want, name, None, param_dtype, id(param))", JUDGE_FAST),
    Edit("state/judge.py", "    if accounted != difference:\n        causes.add(",
         "    if accounted == difference:\n        causes.add(", JUDGE_FAST),
    Edit("state/judge.py", "    if (expected is not None and held.num_elements == numel and dtype != param_dtype",
         "    if (expected is not None and held.num_elements == numel and dtype == param_dtype", JUDGE_FAST),
    Edit("state/judge.py", "        elif frozen:\n            self.causes.add(\"frozen_param_state\"",
         "        elif frozen and False:\n            self.causes.add(\"frozen_param_state\"",
         (f"{JUDGE}::test_state_kept_for_a_parameter_frozen_before_the_trainer_warns_and_reaches_the_summary_and_report",)),
    # -- state/measure.py: what a state holds ----------------------------------------------------
    Edit("state/measure.py", "                continue  # already counted once", "                pass  # already counted once",
         MEASURE),  # a storage met twice (bitsandbytes' shared maps) counted twice
    Edit("state/measure.py", "        if device == \"meta\":\n            continue  # a meta tensor has a shape and no memory",
         "        if device == \"meta_\":\n            continue  # a meta tensor has a shape and no memory", MEASURE),
    Edit("state/measure.py", "        part_elements = sum(size // element_size for size in sizes) if element_size else 0",
         "        part_elements = sum(size for size in sizes) if element_size else 0", MEASURE),
    Edit("state/measure.py", "        if owner != last_owner:\n            num_params_with_state += 1",
         "        if owner == last_owner:\n            num_params_with_state += 1", MEASURE),
    Edit("state/measure.py", "    for name in inner_names:", "    for name in inner_names[:1]:", TORCHAO),
    Edit("state/measure.py", "    if depth >= _MAX_NESTING or id(value) in visiting:",
         "    if depth >= 1 or id(value) in visiting:", MEASURE),
    Edit("state/measure.py", "            column_elements = column_bytes // element_size",
         "            column_elements = column_bytes", MEASURE),
    Edit("state/measure.py", "        num_params_with_state = groups[0][1]", "        num_params_with_state = len(groups)",
         MEASURE),
    Edit("state/measure.py", "    elif isinstance(value, (list, tuple, set, frozenset)):\n        children = list(value)",
         "    elif isinstance(value, (list, tuple, set, frozenset)):\n        children = []", MEASURE),
    Edit("state/measure.py", "    if shared is not None and count > 1:\n        column = [shared]",
         "    if shared is not None and count < 1:\n        column = [shared]", MEASURE,
         equivalent="a tensor held throughout a column is then read once per state; its address repeats, so "
                    "`_count_columns` declines the state and `_count`, which counts each storage once, gives the same "
                    "figures (only slower)"),
    # -- state/rules: the bytes each optimizer keeps -------------------------------------------
    Edit("state/rules/_common.py", "    if not group.get(\"fused\") and torch.get_default_dtype() == torch.float64:\n        return 8",
         "    if not group.get(\"fused\") and torch.get_default_dtype() == torch.float64:\n        return 4",
         (f"{ESTIMATE_RULES}::test_step_is_8_bytes_when_the_default_dtype_is_float64",)),
    Edit("state/rules/_common.py", "return math.prod(shape[:-1]), math.prod(shape[:-2]) * shape[-1]",
         "return math.prod(shape[:-1]), math.prod(shape[:-2]) * shape[-2]", (ESTIMATE_RULES,)),
    Edit("state/rules/_common.py", "    return -(-numel // block_size)", "    return numel // block_size", (ESTIMATE_RULES,)),
    Edit("state/rules/torch_optim.py", "_INCLUDES_FROZEN = {torch.optim.Adagrad}", "_INCLUDES_FROZEN = set()", (ADAGRAD,)),
    Edit("state/rules/torch_optim.py", "\"grad_avg\": \"centered\"", "\"grad_avg\": None", (ESTIMATE_RULES,)),
    Edit("state/rules/torch_optim.py", "        state[\"col_var\"] = col * param.element_size",
         "        state[\"col_var\"] = row * param.element_size", (ESTIMATE_RULES,)),
    Edit("state/rules/bitsandbytes_optim.py",
         "return config[\"optim_bits\"] == 8 and param.numel >= config[\"min_8bit_size\"]",
         "return config[\"optim_bits\"] == 8 and param.numel > config[\"min_8bit_size\"]", (ESTIMATE_RULES,)),
    Edit("state/rules/bitsandbytes_optim.py", "    if optimizer.args.optim_bits == 8 or any(",
         "    if optimizer.args.optim_bits == 32 or any(", (ESTIMATE_RULES,)),
    Edit("state/rules/bitsandbytes_optim.py", "    \"bitsandbytes.optim.adagrad\": (_family(\"Adagrad\"), _ONE_STATE, _ONE_STATE_SOURCE),",
         "    \"bitsandbytes.optim.adagrad\": (_family(\"Adagrad\"), _TWO_STATE, _ONE_STATE_SOURCE),", (ESTIMATE_RULES,)),
    Edit("state/rules/transformers_optim.py",
         "    element_size = 4 if param.dtype in _UPCAST_TO_FP32 else param.element_size",
         "    element_size = param.element_size", (ESTIMATE_RULES,)),
    Edit("state/rules/transformers_optim.py", "    if len(param.shape) >= 2:  # Adafactor._get_options: factored",
         "    if len(param.shape) > 2:  # Adafactor._get_options: factored", (ESTIMATE_RULES,)),
    Edit("state/rules/deepspeed_zero.py", "    return -(-param_numel // world_size)", "    return param_numel // world_size",
         PLAN),
    Edit("state/rules/deepspeed_zero.py", "    alignment = ZERO12_ALIGNMENT_FACTOR * world_size", "    alignment = world_size",
         ZERO_ARITHMETIC),
    Edit("state/rules/deepspeed_zero.py", "        if current >= sub_group_size or index == len(partitions) - 1:",
         "        if current > sub_group_size or index == len(partitions) - 1:", ZERO_ARITHMETIC),
    # -- plan/answers/model_states.py: the model-states plan -------------------------------------------
    Edit("plan/answers/model_states.py", "        fits = margin >= 0", "        fits = margin > 0",
         (f"{PLAN[0]}::test_a_margin_of_exactly_zero_fits_and_one_byte_less_does_not",)),  # exactly 0 fits
    Edit("plan/answers/model_states.py",
         "        grad_numel = sum(numels) if setup.sharding == \"zero1\" else sum(partitions)",
         "            grad_numel = sum(numels) if setup.sharding == \"zero2\" else sum(partitions)",
         PLAN),
    Edit("plan/answers/model_states.py", "    params = sum(specs[i].numel * size[i] for i in range(len(specs)))",
         "    params = sum(specs[i].numel * size[i] for i in trainable)", PLAN),
    Edit("plan/answers/model_states.py", "        cpu += optimizer_bytes + layout.master_weights_bytes", "        cpu += optimizer_bytes",
         PLAN),
    Edit("plan/answers/model_states.py", "                          sum(partitions) * _FP32,",
         "                          sum(partitions) * 2,", PLAN),
    Edit("plan/answers/model_states.py", "layout.master_weights_bytes, total, device, cpu, cpu * setup.processes_per_node,",
         "layout.master_weights_bytes, total, device, cpu, cpu * setup.world_size,", PLAN),
    Edit("plan/answers/model_states.py", "is_embedding=id(param) in embeddings, name=name,", "is_embedding=False, name=name,",
         ("tests/plan/test_whatif_menu.py", *PLAN)),
    Edit("plan/answers/model_states.py", "margin_bytes=margin, fits=None if margin is None else margin >= 0)",
         "margin_bytes=margin, fits=None if margin is None else margin > 0)",
         (f"{PLAN[0]}::test_a_margin_of_exactly_zero_fits_and_one_byte_less_does_not",)),  # with a reference model
    # -- plan/answers/sharding.py: FSDP2's shards ------------------------------------------------------
    Edit("plan/answers/sharding.py", "    return -(-rows // world_size)", "    return rows // world_size", PLAN),
    Edit("plan/answers/sharding.py", "        return (1,)", "        return ()", PLAN),
    Edit("plan/answers/sharding.py", "tuple(shape[1:])", "tuple(shape[2:])", PLAN),
    # -- training/per_optimizer.py: one record per optimizer ----------------------------------
    Edit("training/per_optimizer.py", "        if found is None or found[0]() is not optimizer:",
         "        if found is None:", PER_OPTIMIZER),  # a record left under a reused id taken as the new one's
    Edit("training/per_optimizer.py",
         "if held is not None and isinstance(held[0], _Strong) and held[0]() is optimizer:",
         "if held is not None and held[0]() is optimizer:", PER_OPTIMIZER),
    Edit("training/per_optimizer.py", "            reference = _Strong(optimizer)", "            reference = lambda: None",
         PER_OPTIMIZER),
    Edit("training/per_optimizer.py", "            if held is not None and held[0] is reference:",
         "            if held is not None:", PER_OPTIMIZER,
         equivalent="a weak reference's callback runs as its optimizer dies, before the id can be reused, so the "
                    "record under the key is always the dying optimizer's own; the identity check is a guard"),
    # -- training/monitor.py: the logged figures -----------------------------------------------
    Edit("training/monitor.py", "        if self._peak is None or measurement.num_bytes > self._peak.num_bytes:",
         "        if self._peak is None or measurement.num_bytes < self._peak.num_bytes:",
         (TWO_TRAIN_CALLS, f"{LOOP}::test_breakdown_and_summary_use_the_callbacks_keys_and_file")),
    Edit("training/monitor.py", "                    figures[key] = figures.get(key, 0) + num_bytes",
         "                    figures[key] = num_bytes",
         (f"{LOOP}::test_breakdown_and_summary_use_the_callbacks_keys_and_file",
          f"{MONITOR}::test_breakdown_parts_that_share_a_safe_name_add_up")),
    Edit("training/monitor.py", "            figures[UNEXPECTED_BYTES] = difference", "            figures[UNEXPECTED_BYTES] = abs(difference)",
         (f"{JUDGE}::test_bf16_sgd_with_fp32_momentum_warns_once_and_logs_the_difference",
          f"{JUDGE}::test_no_figure_until_every_trainable_parameter_has_state",
          f"{JUDGE}::test_state_holding_less_than_estimated_logs_a_negative_difference")),
    Edit("training/monitor.py", "            if difference and \"differs\" not in self._warned:",
         "            if \"differs\" not in self._warned:", (f"{JUDGE}::test_agreeing_runs_log_zero_and_warn_nothing",)),
    Edit("training/monitor.py", "        self._latest_step = None\n        self._failed_step = None\n        self._figures_step = None\n"
         "        self._judged = None",
         "        self._failed_step = None\n        self._figures_step = None\n        self._judged = None", (TWO_TRAIN_CALLS,)),
    Edit("training/monitor.py", "            return dict(self._figures)", "            return self._figures",
         (f"{MONITOR}::test_figures_asked_again_at_a_step_are_a_fresh_dict_each_time",)),
    # -- training/model_states_probe.py: parameters and gradients ------------------------------
    Edit("training/model_states_probe.py", "            seen.add(identity)\n", "",
         (f"{MODEL_STATES}::test_tied_weights_count_once",
          f"{MODEL_STATES}::test_parameters_that_are_views_of_one_flat_buffer_count_it_once")),
    Edit("training/model_states_probe.py",
         "            self._layout_bytes = layout.params_bytes + layout.grads_bytes + layout.master_weights_bytes",
         "            self._layout_bytes = layout.params_bytes + layout.master_weights_bytes",
         (f"{MODEL_STATES}::test_docstring_examples_run", f"{MODEL_STATES}::test_trainer_logs_model_states_equal_to_the_plan")),
    Edit("training/model_states_probe.py", "            elif plain.is_meta:\n                continue",
         "            elif plain.is_meta and False:\n                continue", (MODEL_STATES, "-k", "not trainer")),
    Edit("training/model_states_probe.py", "        sharding = \"ddp\" if processes > 1 else \"none\"",
         "        sharding = \"none\"", (MODEL_STATES,),
         equivalent="the plan lays out `none` and `ddp` alike (every process holds the whole model), so the "
                    "figures do not change; only `detect_setup`'s answer would"),
    # -- training/trainer_log_hook.py and callback_logging.py: which log entries get the figures ------
    Edit("training/trainer_log_hook.py", "            for callback in callbacks_of(self, LogContributor):",
         "            for callback in [callback for callback in self.callback_handler.callbacks\n"
         "                             if hasattr(callback, \"contribute_to_trainer_log\")]:",
         (f"{FAULTS}::test_a_foreign_callback_with_the_old_method_name_is_never_called_and_its_run_is_untouched",)),
    # -- training/trainer_method_hook.py: each Trainer method wrapped once, for the log and train hooks --
    Edit("training/trainer_method_hook.py", "        if not self.is_installed():", "        if True:",
         (f"{LIFECYCLE}::test_the_log_hook_wraps_trainer_log_exactly_once",
          f"{CONTRACT}::test_the_trainer_class_hooks_are_marked_and_pass_a_plain_trainer_through")),
    Edit("training/callback_logging.py", "            if prefix and prefix != \"train\":", "            if prefix:",
         (CLOSING,)),  # the closing train_runtime entry gets train_-prefixed figures
    Edit("training/callback_logging.py", "    if \"loss\" in logs:\n        return \"\"", "    if \"loss\" in logs:\n        return None",
         (CLOSING,)),
    # -- training/activations_probe.py: the wrapper of the model's forward ----------------------
    Edit("training/activations_probe.py",
         "if self._wrapper is not wrapper or self._active is not None or not torch.is_grad_enabled():",
         "if self._wrapper is None or self._active is not None or not torch.is_grad_enabled():",
         WRAPPER_UNITS),  # a stale wrapper inside someone else's measures for its probe's new model
    Edit("training/activations_probe.py",
         "counter = self._last if self._last is not None and self._last.alive_bytes > 0 else None",
         "counter = None", SEVERAL_FORWARDS),  # R-Drop: only the last forward counted
    Edit("training/activations_probe.py", "and self._last.alive_bytes > 0 else None",
         "and self._last.alive_bytes >= 0 else None", ACCUMULATION),  # micro-batches merged into one count
    Edit("training/activations_probe.py", "        remove_stale_wrappers(model)\n", "", STALE_IN_A_LOOP),
    Edit("training/activations_probe.py", "not stale\n            owner.disarm()\n", "not stale\n",
         STALE_IN_A_LOOP),  # the stale wrapper's probe stays armed, its counter watching
    Edit("training/activations_probe.py",
         "        if self._call is not None and current_train_call() is not self._call:\n            return None",
         "", NESTED_STEP),  # the nested Trainer's forwards join the outer step's count
    Edit("training/activations_probe.py", "            if owner._call is not None and is_running(owner._call):",
         "            if False:", NESTED_STEP),  # the outer step's wrapper taken for stale: its figures dropped
    Edit("training/activations_probe.py", "        put_back_forward(model, current, mark.replaced)",
         "        put_back_forward(model, current, NO_INSTANCE_FORWARD)", WRAPPER_UNITS),  # the user's own forward dropped
    Edit("training/activations_probe.py", "if compiled or is_compiled(model) or torch.compiler.is_compiling():",
         "if is_compiled(model) or torch.compiler.is_compiling():", FULLGRAPH),
    Edit("training/activations_probe.py", "            if torch.compiler.is_compiling():  # compiled after arming",
         "            if False:  # compiled after arming", WRAPPER_UNITS),
    Edit("training/activations_probe.py", "        elif counter is not self._last:", "        else:", SEVERAL_FORWARDS),
    Edit("training/activations_probe.py", "        owner = weakref.ref(self)\n", "        owner = lambda: self  # noqa: E731\n",
         WRAPPER_UNITS),  # a stale wrapper keeps its probe alive (and measuring)
    # -- training/trainer_train_hook.py and the callback's parts: removed when train() leaves -----------------
    Edit("training/trainer_train_hook.py", "        callback.after_train(trainer, error)", "        pass",
         RAISING_BACKWARD),
    Edit("training/callback_measuring.py", "                if run is self.current:\n                    self.current = None\n                self.uninstall(run)",
         "                if run is self.current:\n                    self.current = None", RAISING_BACKWARD),
    Edit("training/callback_measuring.py", "compiled=bool(getattr(args, \"torch_compile\", False))", "compiled=False", FULLGRAPH),
    Edit("training/evaluation_probe.py", "if compiled or has_compiled_part(model):", "if compiled:",
         COMPILED_RUNS),  # a compiled model's frames skipped by dynamo for good after the first evaluation
    Edit("training/evaluation_probe.py", "        probe = _ARMED[-1] if _ARMED else None\n        if probe is None:\n            return add(",
         "        probe = _ARMED[0] if _ARMED else None\n        if probe is None:\n            return add(",
         (NESTED, "-k", "inside_another")),  # a nested evaluation's batches added to the outer one's figures
    # -- state/saved_tensors.py: what autograd saves, each storage once --------------------------
    Edit("state/saved_tensors.py", "            if key in self._excluded:\n                return ()\n", "",
         SAVED_TENSORS),  # the parameters counted
    Edit("state/saved_tensors.py", "            else:\n                entry[1] += 1\n        return _Saved",
         "            else:\n                entry[1] += 2\n        return _Saved", SAVED_TENSORS),
    Edit("state/saved_tensors.py", "            if entry[1] == 0:", "            if entry[1] <= 1:", SAVED_TENSORS),
    Edit("state/saved_tensors.py", "            torch._C._autograd._pop_saved_tensors_default_hooks()", "            pass",
         SAVED_TENSORS),
    Edit("state/saved_tensors.py", "            packed = self._chained[0](tensor)", "            packed = _detached(tensor)",
         SAVED_TENSORS),  # the user's pair of hooks bypassed
    Edit("state/saved_tensors.py", "                yield from storages_of(getattr(value, name, None), depth + 1)",
         "                yield from ()", SAVED_TENSORS),  # a wrapper subclass's inner tensors missed
    Edit("state/saved_tensors.py", "                checkpoint._recomputation_hook = cls.original", "                pass",
         STALE_IN_A_LOOP),  # checkpoint's hook left wrapped
    Edit("state/saved_tensors.py", "                            weakref.finalize(packed, book.release, key)", "",
         SAVED_TENSORS),  # recomputed tensors never released
    # -- training/zero_gradients.py: DeepSpeed ZeRO-1/2's gradients at its step -------------------
    Edit("training/zero_gradients.py", "            if not any(wanted() for wanted in list(self._wanted.values())):",
         "            if not all(wanted() for wanted in list(self._wanted.values())):", ZERO_TAP),
    Edit("training/zero_gradients.py", "            if not tap._wanted:\n                tap.remove()",
         "            if not tap._wanted:\n                pass", ZERO_TAP),
    Edit("training/zero_gradients.py", "                current._at_step_start()", "                pass", ZERO_TAP),
    Edit("training/zero_gradients.py", "            else:\n                del zero.step", "            else:\n                pass",
         ZERO_TAP),
    Edit("training/zero_gradients.py", "        tap = _TAPS.get(zero)\n        if tap is None:",
         "        tap = None\n        if tap is None:", ZERO_TAP),  # a second owner gets a second wrapper
    # -- plan/step/live_storages.py: the step plan's live bytes ----------------------------------------
    Edit("plan/step/live_storages.py", "                self._tensors[key] = count + 1", "                pass", LIVE_STORAGES),
    Edit("plan/step/live_storages.py", "        if ident in self._seen:\n            return", "        pass", LIVE_STORAGES),
    # (a tensor object met again counted again, its first weak reference replaced: released once, never freed)
    Edit("plan/step/live_storages.py", "            self.peak_keys = list(self._serial.values())",
         "            self.peak_keys = list(self._serial)", LIVE_STORAGES),  # storage addresses for serials
    Edit("plan/step/live_storages.py", "            self.peak_label = self.phase", "            pass", LIVE_STORAGES),
    Edit("plan/step/live_storages.py", "                self._note_companions(out, args)\n        self._check_peak()",
         "                self._note_companions(out, args)", LIVE_STORAGES),  # the peak only where a tensor is added
    # -- plan/step/layer_fold.py: a step of identical layers folded from its steps of 1, 2 and 3
    Edit("plan/step/layer_fold.py", '("mirror", lambda k, m: m + 1 - k)', '("mirror", lambda k, m: m - k)',
         LAYER_FOLD),  # backward's copies named in the wrong order
    Edit("plan/step/layer_fold.py", '        elif token[0] == "r":\n            peak = 0',
         '        elif token[0] == "r":\n            pass', LAYER_FOLD),  # a phase's peak counted from the step's start
    # -- plan/answers/step_memory.py, max_batch.py: the step's peak, its parts, fits? and the largest batch
    Edit("plan/answers/step_memory.py", "    if optimizer_peak is None or fb_peak >= optimizer_peak:",
         "    if optimizer_peak is None or fb_peak < optimizer_peak:",
         OPTIMIZER_PHASE_PEAK),  # the smaller of the two phases' peaks taken
    Edit("plan/answers/step_memory.py", "        at, extra_state = optimizer, not_yet",
         "        at, extra_state = optimizer, 0", OPTIMIZER_PHASE_PEAK),
    # (the first fake step's peak, before the last parameters' state is made, taken as every step's)
    Edit("plan/answers/step_memory.py", "    parts[\"optimizer_state\"] += extra_state", "    pass", OPTIMIZER_PHASE_PEAK),
    # (the peak's parts no longer sum to it)
    Edit("plan/answers/step_memory.py", "timeline.part_of(key, at.saved)", "timeline.part_of(key)", STEP_ON_THE_COMMAND_LINE),
    # (the activations alive at the peak filed under "other")
    Edit("plan/answers/step_memory.py", "        verdict = Verdict(fits=margin >= 0, margin_bytes=margin)",
         "        verdict = Verdict(fits=margin > 0, margin_bytes=margin)", STEP_ON_THE_COMMAND_LINE),
    Edit("plan/answers/step_memory.py",
         "        margin = device.device_memory_bytes - settings.reserve_bytes - traced.peak_bytes",
         "        margin = device.device_memory_bytes - traced.peak_bytes", STEP_ON_THE_COMMAND_LINE),  # the reserve forgotten
    Edit("plan/answers/fit_candidates.py", "    return margin >= 0, margin", "    return margin > 0, margin", SEARCH),
    Edit("plan/answers/max_batch.py", "        if verdict is None:\n            raise _CannotTrace()",
         "        if verdict is None:\n            return False", SEARCH),  # a missing peak read as "does not fit"
    Edit("plan/answers/max_batch.py", "    if not fits(1):\n        return None", "    if not fits(1):\n        return 1",
         SEARCH),  # batch 1 answered where nothing fits
    Edit("plan/answers/step_memory.py", "    return timeline.with_resident(\"optimizer_state\", estimated, state=\"optimizer_state\", group=\"optimizer_state\")",
         "    return timeline", UNTRACEABLE_OPTIMIZER),  # the rule's state left out of the peak
    Edit("plan/answers/step_memory.py", "        timeline = timeline.with_resident(\"reference_model\", reference)", "        pass", STEP_ON_THE_COMMAND_LINE),
    # -- cli/estimate_step.py, estimate_checks.py, device_options.py: the command's reserve, refusals and search
    Edit("plan/answers/max_batch.py", "        problem = next((f\"at batch {plan.settings.per_device_batch} {plan.step.problem}\" for plan in plans\n"
         "                        if plan.step.problem is not None), None)", "        problem = None", SEARCH),
    # (the untraceable search reads as "no batch fits", exit 3)
    Edit("cli/device_options.py", "    return gpu_preset(gpu).cuda_context_bytes if gpu is not None else DEFAULT_CUDA_CONTEXT_BYTES",
         "    return 0", STEP_ON_THE_COMMAND_LINE),  # no CUDA context taken from the device's memory
    Edit("cli/device_options.py", "    if reserve >= args.device_memory:", "    if reserve > args.device_memory:",
         STEP_ON_THE_COMMAND_LINE),  # a reserve equal to the memory leaves 0 bytes, taken
    Edit("cli/estimate_checks.py", "        if count is not None:\n            raise ValueError(f\"a parameter count ({count:,}) cannot be traced",
         "        if count is None:\n            raise ValueError(f\"a parameter count ({count:,}) cannot be traced",
         STEP_ON_THE_COMMAND_LINE),
    Edit("cli/estimate_step.py", "        found, searched = max_batch_size(plan_at, memory, first=first, unit=unit)",
         "        found, searched = max_batch_size(plan_at, args.device_memory, first=first, unit=unit)",
         STEP_ON_THE_COMMAND_LINE),
    # (the largest batch searched against the memory with the reserve not taken off)
    Edit("cli/estimate_checks.py", "not (asked.evaluation and name in _EVAL_OPTIONS)]", "not asked.evaluation]",
         (CLI_ANSWERS, "tests/cli/test_cli_eval.py")),  # with --eval-samples every step option let through
    Edit("cli/estimate_settings.py", "\"reserve_bytes\": reserve_bytes(args),", "\"reserve_bytes\": None,", STEP_ON_THE_COMMAND_LINE),
    # -- the step time's FLOPs and the user's tensor-parallel rules ------------------------------
    Edit("plan/step/flops.py", "    offset = seq_k - seq_q if bottom_right else 0", "    offset = 0", FLOPS),
    Edit("plan/step/flops.py", "    if bound[\"causal\"]:\n        right = 0", "    if bound[\"causal\"]:\n        right = -1",
         FLOPS),  # flash-attn's causal window counted whole
    Edit("plan/model/tp_plan.py", "        return {**_transformers_plan(model), **override}",
         "        return {**override, **_transformers_plan(model)}", TP_RULES),  # the model's rules over the user's
]


def edit_name(edits: Sequence[Edit], edit: Edit) -> str:
    """`state/judge.py#2`: the module and the edit's number within it, from 1."""
    same = [other for other in edits if other.module == edit.module]
    return f"{edit.module}#{same.index(edit) + 1}"


# -- the copy ---------------------------------------------------------------------------------------


def _repository_files(root: str) -> Optional[List[str]]:
    """Tracked and untracked files that git does not ignore, or None without git."""
    try:
        listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                                cwd=root, capture_output=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return [name for name in listed.stdout.decode("utf-8", "surrogateescape").split("\0") if name]


_SKIPPED = shutil.ignore_patterns(".git", "__pycache__", "*.egg-info", "build", "dist", ".pytest_cache", "*.pyc")


def copy_repository(root: str, into: str) -> None:
    """A plain copy of the working tree (edits not yet committed included), never a git worktree."""
    files = _repository_files(root)
    if files is None:
        shutil.copytree(root, into, ignore=_SKIPPED, dirs_exist_ok=True)
        return
    for name in files:
        source = os.path.join(root, name)
        if not os.path.isfile(source) or os.path.islink(source):
            continue  # deleted but still tracked, or a link: nothing the tests read
        target = os.path.join(into, name)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        shutil.copy2(source, target)


def test_environment(copy: str) -> Dict[str, str]:
    environment = dict(os.environ)
    # The copy's package comes first, whatever the venv installed (an editable install points at
    # the working tree); no bytecode is written, so a restored file is never shadowed by the .pyc
    # of its edited version written in the same second.
    environment["PYTHONPATH"] = copy + os.pathsep + environment.get("PYTHONPATH", "")
    environment["PYTHONDONTWRITEBYTECODE"] = "1"
    environment.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1",
                       WANDB_MODE="disabled", TOKENIZERS_PARALLELISM="false")
    return environment


def check_copy_is_imported(copy: str) -> None:
    """Refuse to run if the tests would import the package from anywhere but the copy."""
    # `find_spec` locates the package the way an import would, without running it (no torch import).
    locate = f"import importlib.util; print(importlib.util.find_spec({PACKAGE!r}).origin)"
    found = subprocess.run([sys.executable, "-c", locate], cwd=copy, env=test_environment(copy),
                           capture_output=True, text=True)
    where = os.path.realpath(found.stdout.strip()) if found.returncode == 0 else ""
    if not where.startswith(os.path.realpath(copy) + os.sep):
        raise SystemExit(f"the tests in the copy import {PACKAGE} from {where or found.stderr.strip()!r}, "
                         f"not from the copy {copy}: the mutation check cannot run here")


# -- running ----------------------------------------------------------------------------------------


@dataclass
class Result:
    name: str
    edit: Edit
    outcome: str  # killed, survived, timeout, equivalent, baseline failed, no tests
    seconds: float
    detail: str = ""


def run_tests(copy: str, tests: Sequence[str], timeout: float) -> Tuple[Optional[int], float, str]:
    """(pytest's exit status, or None on timeout; seconds; the last lines of its output)."""
    started = time.perf_counter()
    with subprocess.Popen(PYTEST + list(tests), cwd=copy, env=test_environment(copy), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True) as process:
        with _RUNNING_LOCK:
            _RUNNING.add(process)
        try:
            output, _ = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.communicate()
            return None, time.perf_counter() - started, ""
        finally:
            with _RUNNING_LOCK:
                _RUNNING.discard(process)
    tail = "\n".join(output.strip().splitlines()[-3:])
    return process.returncode, time.perf_counter() - started, tail


# The test runs under way, so that an interrupted check stops them rather than leaving them behind.
_RUNNING: Set[subprocess.Popen] = set()
_RUNNING_LOCK = threading.Lock()


def stop_running() -> None:
    with _RUNNING_LOCK:
        for process in _RUNNING:
            process.kill()


def _terminated(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


class Workers:
    """One copy of the repository per job; a job takes a free copy, edits it, runs, restores it."""

    def __init__(self, jobs: int) -> None:
        self._free: List[str] = []
        self._lock = threading.Lock()
        self._root = tempfile.mkdtemp(prefix="trainer_memcb-mutations-")
        for index in range(jobs):
            copy = os.path.join(self._root, f"copy{index}")
            os.makedirs(copy)
            copy_repository(REPO_ROOT, copy)
            self._free.append(copy)
        check_copy_is_imported(self._free[0])

    def take(self) -> str:
        with self._lock:
            return self._free.pop()

    def give_back(self, copy: str) -> None:
        with self._lock:
            self._free.append(copy)

    def close(self) -> None:
        shutil.rmtree(self._root, ignore_errors=True)


def module_path(copy: str, edit: Edit) -> str:
    return os.path.join(copy, PACKAGE, *edit.module.split("/"))


def test_paths(tests: Sequence[str]) -> List[str]:
    """The files and node ids among pytest arguments (options such as `-k EXPR` left out)."""
    paths, skip = [], False
    for argument in tests:
        if skip:
            skip = False
        elif argument.startswith("-"):
            skip = argument in ("-k", "-m")
        else:
            paths.append(argument)
    return paths


def union_of(selections: Iterable[Sequence[str]]) -> List[str]:
    """Every file and node id of the selections, options dropped (so a `-k` filter widens to its
    whole file): a node id is left out where its whole file is in."""
    paths = list(dict.fromkeys(path for tests in selections for path in test_paths(tests)))
    files = {path for path in paths if "::" not in path}
    return [path for path in paths if "::" not in path or path.split("::")[0] not in files]


def check_edits(edits: Iterable[Edit]) -> List[str]:
    """Problems with the edit list itself: text not found exactly once, a test file missing."""
    problems = []
    for edit in edits:
        with open(module_path(REPO_ROOT, edit), encoding="utf-8") as handle:
            count = handle.read().count(edit.old)
        if count != 1:
            problems.append(f"{edit_name(EDITS, edit)}: {edit.old!r} occurs {count} times, not once")
        if edit.old == edit.new:
            problems.append(f"{edit_name(EDITS, edit)}: the edit changes nothing")
        for test in test_paths(edit.tests):
            if not os.path.isfile(os.path.join(REPO_ROOT, test.split("::")[0])):
                problems.append(f"{edit_name(EDITS, edit)}: no test file {test.split('::')[0]}")
    return problems


def run_edit(workers: Workers, edit: Edit, timeout: float) -> Result:
    name = edit_name(EDITS, edit)
    copy = workers.take()
    path = module_path(copy, edit)
    with open(path, encoding="utf-8") as handle:
        original = handle.read()
    try:
        with open(path, "w", encoding="utf-8") as handle:
            handle.write(original.replace(edit.old, edit.new, 1))
        status, seconds, tail = run_tests(copy, edit.tests, timeout)
    finally:
        with open(path, "w", encoding="utf-8") as handle:
            handle.write(original)
        workers.give_back(copy)
    if status is None:
        return Result(name, edit, "timeout", seconds, "killed by the time limit")
    if status == 0:
        return Result(name, edit, "survived", seconds, tail)
    if status == 5:
        return Result(name, edit, "no tests", seconds, tail)
    return Result(name, edit, "killed", seconds, tail)


def run_baseline(workers: Workers, tests: Tuple[str, ...], timeout: float) -> Tuple[Tuple[str, ...], bool, float, str]:
    copy = workers.take()
    try:
        status, seconds, tail = run_tests(copy, tests, timeout)
    finally:
        workers.give_back(copy)
    return tests, status == 0, seconds, tail


def baseline(pool: ThreadPoolExecutor, workers: Workers, edits: Sequence[Edit], timeout: float) -> Dict[Tuple[str, ...], str]:
    """The selections that fail unchanged, with their output's last lines.

    All of them run first in one run (each selection is part of it: one start-up instead of one
    per selection); only if that fails does each run on its own, to tell which."""
    selections = list(dict.fromkeys(edit.tests for edit in edits))
    union = union_of(selections)
    print(f"baseline: {len(union)} test files and node ids, unchanged, in one run", flush=True)
    _, passed, seconds, tail = run_baseline(workers, tuple(union), timeout * 4)
    print(f"  {'passed' if passed else 'FAILED'} ({seconds:.1f} s)", flush=True)
    failed: Dict[Tuple[str, ...], str] = {}
    if passed:
        return failed
    print(f"  {tail}\n  each of the {len(selections)} selections on its own:", flush=True)
    for tests, passed, seconds, tail in pool.map(lambda t: run_baseline(workers, t, timeout), selections):
        if not passed:
            failed[tests] = tail
            print(f"  FAILS unchanged ({seconds:.1f} s): {' '.join(tests)}\n    {tail}", flush=True)
    return failed


def run_one(workers: Workers, edit: Edit, timeout: float) -> Result:
    result = run_edit(workers, edit, timeout)
    print(f"  {result.name}: {result.outcome} ({result.seconds:.1f} s)", flush=True)
    return result


def _short(text: str, width: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 3] + "..."


def describe(edit: Edit, width: int = 90) -> str:
    return _short(f"{edit.old.strip()} -> {edit.new.strip() or '(removed)'}", width)


def print_list(edits: Sequence[Edit]) -> None:
    for edit in edits:
        print(f"{edit_name(EDITS, edit)}: {describe(edit, 200)}")
        print(f"    tests: {' '.join(edit.tests)}")
        if edit.equivalent:
            print(f"    equivalent: {edit.equivalent}")


def print_table(results: Sequence[Result]) -> None:
    rows = [(result.name, describe(result.edit, 70), result.outcome,
             "" if result.outcome == "equivalent" else f"{result.seconds:.1f}") for result in results]
    headers = ("module#edit", "edit", "result", "seconds")
    widths = [max(len(headers[i]), *(len(row[i]) for row in rows)) for i in range(4)]
    line = "  ".join(f"{{:<{width}}}" for width in widths[:3]) + f"  {{:>{widths[3]}}}"
    print(line.format(*headers))
    print(line.format(*("-" * width for width in widths)))
    for row in rows:
        print(line.format(*row))


def parser() -> argparse.ArgumentParser:
    made = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    made.add_argument("--list", action="store_true", help="list the edits and their tests; run nothing")
    made.add_argument("--only", metavar="MODULE", action="append", default=[],
                      help="only the edits of modules whose path contains MODULE (repeatable)")
    made.add_argument("--edit", metavar="NAME", action="append", default=[],
                      help="only this edit, e.g. state/judge.py#1 (repeatable)")
    made.add_argument("--jobs", type=int, default=1, help="edits run side by side, one repository copy each (default 1)")
    made.add_argument("--timeout", type=float, default=900.0, help="seconds per test run before it counts as killed")
    made.add_argument("--no-baseline", action="store_true", help="skip the unchanged run of each test selection")
    return made


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parser().parse_args(argv)
    if args.jobs < 1:
        print(f"--jobs={args.jobs}: expected 1 or more", file=sys.stderr)
        return 2
    problems = check_edits(EDITS)
    if problems:
        print("\n".join(problems), file=sys.stderr)
        return 2
    names = {edit_name(EDITS, edit): edit for edit in EDITS}
    unknown = [name for name in args.edit if name not in names]
    if unknown:
        print(f"--edit {', '.join(unknown)}: not an edit; --list shows them", file=sys.stderr)
        return 2
    chosen = [edit for edit in EDITS
              if (not args.only or any(part in edit.module for part in args.only))
              and (not args.edit or edit_name(EDITS, edit) in args.edit)]
    if not chosen:
        print("no edit matches --only/--edit; --list shows them", file=sys.stderr)
        return 2
    if args.list:
        print_list(chosen)
        return 0

    to_run = [edit for edit in chosen if not edit.equivalent]
    started = time.perf_counter()
    signal.signal(signal.SIGTERM, _terminated)
    workers = Workers(min(args.jobs, max(1, len(to_run))))
    try:
        with ThreadPoolExecutor(max_workers=args.jobs) as pool:
            try:
                failed_baselines = {} if args.no_baseline else baseline(pool, workers, to_run, args.timeout)
                runnable = [edit for edit in to_run if edit.tests not in failed_baselines]
                print(f"{len(runnable)} edits to run, {args.jobs} at a time", flush=True)
                ran = {result.name: result for result in pool.map(lambda edit: run_one(workers, edit, args.timeout),
                                                                  runnable)}
            except BaseException:
                stop_running()  # before the pool waits for its threads
                raise
    finally:
        workers.close()

    results = []
    for edit in chosen:
        name = edit_name(EDITS, edit)
        if edit.equivalent:
            results.append(Result(name, edit, "equivalent", 0.0, edit.equivalent))
        elif edit.tests in failed_baselines:
            results.append(Result(name, edit, "baseline failed", 0.0, failed_baselines[edit.tests]))
        else:
            results.append(ran[name])
    print()
    print_table(results)
    counted = [result for result in results if result.outcome in ("killed", "timeout", "survived", "no tests")]
    killed = [result for result in counted if result.outcome in ("killed", "timeout")]
    survivors = [result for result in counted if result not in killed]
    equivalent = sum(result.outcome == "equivalent" for result in results)
    print()
    if counted:
        print(f"kill rate: {len(killed)}/{len(counted)} = {100 * len(killed) / len(counted):.1f}% "
              f"({equivalent} equivalent edits not counted; {time.perf_counter() - started:.0f} s in all)")
    for result in survivors:
        print(f"survived: {result.name}: {describe(result.edit, 200)}\n    tests: {' '.join(result.edit.tests)}")
    for result in results:
        if result.outcome == "equivalent":
            print(f"equivalent: {result.name}: {result.detail}")
    return 1 if survivors or failed_baselines else 0


if __name__ == "__main__":
    sys.exit(main())
