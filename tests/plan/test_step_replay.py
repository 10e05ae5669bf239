"""The step plan's allocations replayed through the caching allocator over two steps: exact bytes
on tiny Llamas under every engine, torch_empty_cache_steps, expandable segments, fits? from the
replay, and the CUDA workspaces."""

import pytest
import transformers
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from trainer_memcb.plan.answers.step_memory import plan_step_memory
from trainer_memcb.plan.answers.step_replay import replay_step, step_allocations, step_replayer
from trainer_memcb.plan.device.caching_allocator import CachingAllocatorModel, replay_allocations
from trainer_memcb.plan.device.gpus import DEFAULT_CUDA_CONTEXT_BYTES
from trainer_memcb.plan.settings import resolve_settings
from trainer_memcb.plan.step.trace import trace_step

# The exact figures here were counted on torch 2.13 and transformers 5. On transformers 4.57 the
# models hold 16 to 32 bytes of buffers more or less (rotary's original_inv_freq is an attribute
# there) and torch 2.6's fake process group cannot run FSDP2's all-gather, so the oldest pass does
# not hold these figures (tests/plan/test_engines.py computes that difference for its own).
pytestmark = pytest.mark.skipif(
    tuple(int(part) for part in torch.__version__.split(".")[:2]) < (2, 13)
    or int(transformers.__version__.split(".")[0]) < 5,
    reason="figures counted on torch 2.13 and transformers 5; the oldest releases differ by model buffers")


MiB = 1024 ** 2


def _build(hidden=64, vocab=256):
    def build():
        with torch.device("meta"):
            return LlamaForCausalLM(LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                                                num_attention_heads=4, vocab_size=vocab))
    return build


def _timeline(sharding="none", hidden=64, vocab=256, seq_len=16):
    settings = resolve_settings(world_size=1 if sharding == "none" else 2, sharding=sharding, batch_size=2,
                                seq_len=seq_len, optimizer="adamw_torch", device_type="cuda")
    return trace_step(_build(hidden, vocab)(), settings, args=None, step_dtype=torch.float32)


ENGINES = ["none", "ddp", "fsdp-full-shard", "zero2", "zero3"]


@pytest.fixture(scope="module")
def timelines():
    return {sharding: _timeline(sharding) for sharding in ENGINES}


# (reserved peak, allocated peak, fragmentation: the reserved peak less the allocated peak) of two
# steps of a tiny Llama (hidden 64, 2 layers, vocab 256, batch 2 x 16, fp32, AdamW foreach) per process; the cuBLAS and
# cuBLASLt workspaces of sm80 (8,519,680 + 1,048,576 bytes, two handles) are 19,136,512 of them.
# ZeRO's reduce and all-gather buckets (500M elements by default) make its figures. fp32 attention
# takes the memory-efficient kernel on an sm80 card, whose logsumexp is padded to 32 rows: 512 bytes
# a layer more than the CPU kernel's, alive at the sharded engines' peaks.
EXPECTED = {
    "none": (27_262_976, 21_454_336, 5_808_640),
    "ddp": (27_262_976, 21_906_944, 5_356_032),
    # FSDP2's all-gather outputs are allocated on its all-gather copy-in stream and its sharded
    # gradients on its reduce-scatter stream: each stream takes a 2 MiB small segment of its own
    # (tests/plan/test_step_streams.py), 4 MiB more than the same allocations on one stream.
    # Its allocated peak is in an attention backward, where the memory-efficient kernel's delta and
    # workspace are alive (plan/device/efficient_attention.py).
    "fsdp-full-shard": (29_360_128, 20_872_704, 8_487_424),
    "zero2": (2_025_848_832, 2_021_368_832, 4_480_000),
    "zero3": (2_025_848_832, 2_021_870_592, 3_978_240),
}


@pytest.mark.parametrize("sharding", ENGINES)
def test_reserved_figures_per_engine(timelines, sharding):
    replay = replay_step(timelines[sharding], alloc_conf="")
    assert (replay.reserved_peak_bytes, replay.allocated_peak_bytes, replay.fragmentation_bytes) == EXPECTED[sharding]
    assert replay.cuda_workspace_bytes == 2 * (8_519_680 + 1_048_576)
    assert replay.oom is None


@pytest.mark.parametrize("sharding", ENGINES)
def test_second_step_ends_where_the_first_ended(timelines, sharding):
    """Step 2 makes no optimizer state or engine buffer again and frees what it makes: the bytes
    allocated at its end are those at the end of step 1 (the steady state of every later step)."""
    calls = step_allocations(timelines[sharding])
    first = [call for call, where in calls if where.startswith("step 1")]
    assert replay_allocations(first).allocated_bytes == replay_allocations([call for call, _ in calls]).allocated_bytes
    # The batch is made anew before the old one is freed, as the Trainer's loop holds it.
    second = [call for call, where in calls if where == "step 2, setup"]
    batch = sorted(timelines[sharding].groups["batch"])
    assert second == [("alloc", (2, s), timelines[sharding].sizes[s]) for s in batch] + [("free", s) for s in batch]


@pytest.mark.parametrize("sharding", ["none", "ddp", "fsdp-full-shard", "zero3"])
def test_the_replayed_peak_holds_the_traced_peak(sharding):
    """The second step holds at its peak every storage the trace holds at the plan's peak (the
    optimizer state alive from the first step), each in a block of at least its bytes, beside the
    cuBLAS workspaces."""
    settings = resolve_settings(world_size=1 if sharding == "none" else 2, sharding=sharding, batch_size=2,
                                optimizer="adamw_torch")
    step, _ = plan_step_memory(_build(), seq_len=16, settings=settings, model_states=False, alloc_conf="")
    assert step.device.allocator_allocated_peak_bytes >= step.step.peak_bytes + step.device.cuda_workspace_bytes


def test_cublas_workspaces_at_the_first_matmul_of_forward_and_backward(timelines):
    calls = step_allocations(timelines["none"], compute_capability=(9, 0))
    workspaces = [(call, where) for call, where in calls if call[0] == "alloc" and isinstance(call[1], tuple)
                  and call[1][0] in ("cublas", "cublaslt")]
    assert workspaces == [(("alloc", ("cublas", "forward"), 33_554_432), "step 1, forward"),
                          (("alloc", ("cublaslt", "forward"), 1_048_576), "step 1, forward"),
                          (("alloc", ("cublas", "backward"), 33_554_432), "step 1, backward"),
                          (("alloc", ("cublaslt", "backward"), 1_048_576), "step 1, backward")]


def test_empty_cache_steps_release_the_cache_after_the_forward():
    """torch_empty_cache_steps: empty_cache() where Trainer.training_step calls it (after the
    forward, before the backward) in step 1 (global step 0) always, in step 2 only for N = 1; there
    the reserved bytes drop by the segments the forward freed whole (the fp32 logits), the optimizer state
    staying in step 2."""
    timeline = _timeline(hidden=128, vocab=32000, seq_len=64)
    backward = timeline.phase_starts["backward"]
    for steps, expected in ((1, ["step 1, backward", "step 2, backward"]), (2, ["step 1, backward"])):
        calls = step_allocations(timeline, empty_cache_steps=steps)
        assert [where for call, where in calls if call == ("empty_cache",)] == expected
    assert [where for call, where in step_allocations(timeline) if call == ("empty_cache",)] == []
    model = CachingAllocatorModel("")
    dropped = []
    for call, where in step_allocations(timeline, empty_cache_steps=1):
        if call[0] == "alloc":
            model.malloc(call[1], call[2])
        elif call[0] == "free":
            model.free(call[1])
        else:
            before = model.reserved
            model.empty_cache()
            dropped.append((where, before, model.reserved))
    assert dropped == [("step 1, backward", 94_371_840, 77_594_624), ("step 2, backward", 199_229_440, 148_897_792)]
    assert backward > timeline.phase_starts["forward"]


def test_expandable_segments_change_the_reserved_figure(timelines):
    default = replay_step(timelines["zero2"], alloc_conf="")
    expandable = replay_step(timelines["zero2"], alloc_conf="expandable_segments:True")
    assert (default.reserved_peak_bytes, expandable.reserved_peak_bytes) == (2_025_848_832, 2_038_431_744)
    assert expandable.allocated_peak_bytes == 2_020_685_824


def test_fits_allocated_but_not_reserved_does_not_fit():
    """22 MiB for the allocator holds the 21,454,336 bytes allocated at the peak, but not the
    segments they need: the replay runs out of memory, so the step does not fit; 26 MiB (the
    reserved peak) fits with nothing to spare."""
    settings = resolve_settings(batch_size=2, optimizer="adamw_torch")
    plans = {}
    for room in (22 * MiB, 26 * MiB):
        plans[room], _ = plan_step_memory(_build(), seq_len=16, settings=settings, model_states=False,
                                          device_memory=DEFAULT_CUDA_CONTEXT_BYTES + room, alloc_conf="")
    short, enough = plans[22 * MiB], plans[26 * MiB]
    assert short.device.allocator_allocated_peak_bytes == 21_454_336 < 22 * MiB < short.device.reserved_peak_bytes == 27_262_976
    assert (short.verdict.fits, short.verdict.margin_bytes, short.device.out_of_memory_at) == (False, -4 * MiB, "step 1, backward")
    assert (enough.verdict.fits, enough.verdict.margin_bytes, enough.device.out_of_memory_at) == (True, 0, None)
    assert enough.device.device_total_bytes == 27_262_976 + DEFAULT_CUDA_CONTEXT_BYTES
    assert enough.step.peak_bytes == 2_299_800  # the trace's own figure is unchanged


def test_gpu_preset_gives_memory_context_and_workspaces():
    settings = resolve_settings(batch_size=2, optimizer="adamw_torch")
    step, _ = plan_step_memory(_build(), seq_len=16, settings=settings, model_states=False, gpu="h100", alloc_conf="")
    assert (step.device.gpu, step.device.device_memory_bytes, step.device.cuda_context_bytes) == ("H100", 85_045_477_376, 446_693_376)
    assert step.device.cuda_workspace_bytes == 2 * (33_554_432 + 1_048_576)
    assert step.device.reserved_peak_bytes == 73_400_320
    assert step.verdict.margin_bytes == 85_045_477_376 - 446_693_376 - 73_400_320 and step.verdict.fits is True


def test_cpu_plans_have_no_allocator_figures():
    settings = resolve_settings(batch_size=2, optimizer="adamw_torch")
    step, _ = plan_step_memory(_build(), seq_len=16, settings=settings, model_states=False, device_type="cpu",
                               device_memory=10_000_000)
    assert step.device.reserved_peak_bytes is None and step.device.device_total_bytes is None
    assert (step.verdict.fits, step.verdict.margin_bytes) == (True, 10_000_000 - step.step.peak_bytes)
    assert step.verdict.margin_bytes == 7_995_112


@pytest.mark.parametrize("option, value, named", [("gpu", "a200", "'a200'"), ("alloc_conf", "foo:1", "'foo'"),
                                                  ("gpu", "v100", "V100-16GB")])
def test_bad_gpu_or_alloc_conf_is_refused(option, value, named):
    settings = resolve_settings(batch_size=1, optimizer="adamw_torch")
    with pytest.raises(ValueError, match=named):
        plan_step_memory(_build(), seq_len=8, settings=settings, model_states=False, **{option: value})


def test_alloc_conf_is_read_from_the_environment(monkeypatch):
    settings = resolve_settings(batch_size=2, optimizer="adamw_torch")
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    step, _ = plan_step_memory(_build(), seq_len=16, settings=settings, model_states=False)
    assert step.device.alloc_conf == "expandable_segments:True"
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:1")
    with pytest.raises(ValueError, match="max_split_size_mb"):
        plan_step_memory(_build(), seq_len=16, settings=settings, model_states=False)


def test_the_evaluation_plan_uses_the_same_rule():
    """On CUDA the evaluation's allocations are replayed too: a tiny Llama's device peak of 65,160
    bytes needs one 2 MiB small-pool segment, so 2 MiB beside the context fits and a byte less does
    not, though the device peak would fit."""
    from trainer_memcb.plan.answers.eval_memory import EvalSettings, plan_eval_memory

    def build():
        with torch.device("meta"):
            return LlamaForCausalLM(LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                                num_attention_heads=2, vocab_size=100))

    settings = EvalSettings(batch_size=2, samples=4, seq_len=8)
    context = DEFAULT_CUDA_CONTEXT_BYTES
    fits = plan_eval_memory(build, settings, device_memory=context + 2 * MiB, cuda_context_bytes=context, alloc_conf="")
    short = plan_eval_memory(build, settings, device_memory=context + 2 * MiB - 1, cuda_context_bytes=context,
                             alloc_conf="")
    assert (fits.device_peak_bytes, fits.reserved_peak_bytes, fits.device_total_bytes) == (65_160, 2 * MiB,
                                                                                           2 * MiB + context)
    assert (fits.fits_device, short.fits_device) == (True, False)
    assert plan_eval_memory(build, settings, device_memory=2 * MiB - 1).fits_device is True  # no CUDA: the peak


def test_a_replayer_makes_its_calls_once_and_replays_them_under_each_limit(timelines, monkeypatch):
    from trainer_memcb.plan.answers import step_replay

    made = []
    original = step_replay._calls
    monkeypatch.setattr(step_replay, "_calls", lambda *args: made.append(args[1:]) or original(*args))
    timeline = timelines["none"]
    replay_under = step_replayer(timeline, compute_capability=(9, 0))
    free = replay_under(None, None)
    limited = replay_under(None, free.reserved_peak_bytes - 1)
    assert len(made) == 1 and limited.oom is not None  # the same calls, replayed under the limit
    assert free == replay_step(timeline, compute_capability=(9, 0))
    assert len(made) == 2  # a plain replay makes its own: no timeline is kept between calls
    # Other workspaces (sm80's, then an environment's) or emptying the cache: the calls' arguments,
    # and the workspaces' bytes counted from them (two handles).
    assert replay_step(timeline, compute_capability=(8, 0)).cuda_workspace_bytes == 2 * (8_519_680 + 1_048_576)
    env = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
    assert replay_step(timeline, compute_capability=(8, 0), env=env).cuda_workspace_bytes == 2 * (33_554_432 + 1_048_576)
    replay_step(timeline, compute_capability=(8, 0), env=env, empty_cache_steps=1)
    assert made[2:] == [((8_519_680, 1_048_576), None), ((33_554_432, 1_048_576), None),
                        ((33_554_432, 1_048_576), 1)]
    assert made[0] == made[1] == ((33_554_432, 1_048_576), None)
