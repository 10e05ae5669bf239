"""PYTORCH_CUDA_ALLOC_CONF read as torch reads it: PyTorch's own parser tests
(`c10/test/core/AllocatorConfig_test.cpp`, `allocator_config_test` and
`malformed_config_raises_value_error`; `test/test_cuda.py`, `test_allocator_settings`), and the
checks of each key."""

from __future__ import annotations

import pytest

from trainer_memcb.plan.device.alloc_conf import (
    AllocConf,
    alloc_conf_from_environment,
    as_alloc_conf,
    parse_alloc_conf,
)

MiB = 1024 ** 2


def test_allocator_config_test_first_config() -> None:
    # AllocatorConfig_test.cpp's first string, less its test-only device-specific key.
    conf = parse_alloc_conf(
        "max_split_size_mb:40,max_non_split_rounding_mb:30,garbage_collection_threshold:0.5,"
        "roundup_power2_divisions:[64:8,128:2,256:4,512:2,1024:4,>:1],expandable_segments:True,"
        "pinned_use_background_threads:True"
    )
    assert conf.large_segment_size_bytes == 20 * MiB
    assert conf.max_split_size_bytes == 40 * MiB
    assert conf.max_non_split_rounding_bytes == 30 * MiB
    assert conf.garbage_collection_threshold == 0.5
    expected = {32: 8, 64: 8, 128: 2, 256: 4, 512: 2, 1024: 4, 2048: 1, 4096: 1, 8192: 1}
    assert {mib: conf.divisions_for(mib * MiB) for mib in expected} == expected
    assert conf.expandable_segments is True


def test_allocator_config_test_large_segment_and_split_sizes() -> None:
    conf = parse_alloc_conf("large_segment_size_mb:15,max_split_size_mb:20,"
                            "max_non_split_rounding_mb:40,garbage_collection_threshold:0.8")
    assert (conf.large_segment_size_bytes, conf.max_split_size_bytes,
            conf.max_non_split_rounding_bytes, conf.garbage_collection_threshold) == (
        15 * MiB, 20 * MiB, 40 * MiB, 0.8)


def test_allocator_config_test_divisions_list_and_single_value() -> None:
    conf = parse_alloc_conf("roundup_power2_divisions:[128:8,256:16,512:1,2048:8,>:2]")
    expected = {64: 8, 128: 8, 256: 16, 512: 1, 1024: 0, 2048: 8, 4096: 2}
    assert {mib: conf.divisions_for(mib * MiB) for mib in expected} == expected
    conf = parse_alloc_conf("roundup_power2_divisions:4")
    assert [conf.divisions_for(mib * MiB) for mib in (64, 256, 2048)] == [4, 4, 4]
    # Sizes below 2 MiB share the first interval, 32 GiB and above the last.
    assert conf.roundup_power2_divisions == (4,) * 16


def test_defaults_and_a_trailing_comma() -> None:
    assert parse_alloc_conf("") == AllocConf()
    assert AllocConf().max_split_size_bytes == 2 ** 64 - 1
    assert AllocConf().max_non_split_rounding_bytes == 20 * MiB
    assert parse_alloc_conf("expandable_segments:False,").expandable_segments is False
    assert parse_alloc_conf(" expandable_segments : True ").expandable_segments is True


def test_max_non_split_rounding_follows_the_large_segment() -> None:
    # parseArgs: max_non_split_rounding_size_ = large_segment_size_ before the other keys.
    assert parse_alloc_conf("large_segment_size_mb:32").max_non_split_rounding_bytes == 32 * MiB


@pytest.mark.parametrize("text, named", [
    ("max_split_size_mb:20,large_segment_size_mb:25", "max_split_size_mb too small, must be >= 25"),
    ("foo:123,bar:456", "unrecognized key 'foo'"),
    ("foo:1,bar:2", "unrecognized key 'foo'"),  # test_cuda.py, test_allocator_settings
    ("garbage_collection_threshold:1.2", "must be in (0.0, 1.0), got 1.2"),
    ("max_split_size_mb:2", "max_split_size_mb too small, must be >= 20, got 2"),
    ("max_split_size_mb", "the config ends where ':' after 'max_split_size_mb'"),
    ("max_split_size_mb:", "the config ends where the value of 'max_split_size_mb'"),
    ("roundup_power2_divisions:[64:8", "']' closing 'roundup_power2_divisions'"),
    ("garbage_collection_threshold:", "garbage_collection_threshold"),
    ("large_segment_size_mb:10", "large_segment_size_mb must be more than 10, got 10"),
    ("roundup_power2_divisions:3", "must be a power of 2, got 3"),
    ("roundup_power2_divisions:[100:4]", "an interval must be a power of 2 (in MiB), got 100"),
    ("roundup_power2_divisions:[64:3]", "power of 2, or 0 to disable rounding, got 3"),
    ("expandable_segments:true", "must be True or False (spelled so), got 'true'"),
    ("max_split_size_mb:-5", "a whole number of 0 or more, got '-5'"),
    ("per_process_memory_fraction:1.5", "must be in [0.0, 1.0], got 1.5"),
    ("backend:async", "unknown allocator backend 'async'; options are native and cudaMallocAsync"),
    ("pinned_num_register_threads:3", "has to be a power of 2, got 3"),
    ("pinned_num_register_threads:256", "should be at most 128, got 256"),
    ("pinned_reserve_segment_size_mb:0", "has to be greater than 0, got 0"),
    ("max_split_size_mb,40", "expected ':' after 'max_split_size_mb', found ','"),
    ("expandable_segments:True;max_split_size_mb:40", "must be True or False"),
])
def test_bad_configs_raise_value_errors_that_name_them(text: str, named: str) -> None:
    with pytest.raises(ValueError) as raised:
        parse_alloc_conf(text)
    assert named in str(raised.value)
    assert repr(text) in str(raised.value)


def test_every_other_cuda_key_is_accepted_and_checked() -> None:
    conf = parse_alloc_conf(
        "backend:native,release_lock_on_cudamalloc:True,pinned_use_cuda_host_register:False,"
        "pinned_num_register_threads:8,pinned_reserve_segment_size_mb:64,"
        "graph_capture_record_stream_reuse:True,per_process_memory_fraction:0.75,"
        "pinned_free_catch_all:False,throw_on_cudamalloc_oom:True"
    )
    assert (conf.backend, conf.per_process_memory_fraction) == ("native", 0.75)
    assert parse_alloc_conf("backend:cudaMallocAsync").backend == "cudaMallocAsync"


def test_the_environment_is_read_as_torch_reads_it() -> None:
    both = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
            "PYTORCH_ALLOC_CONF": "max_split_size_mb:64"}
    conf = alloc_conf_from_environment(both)
    assert (conf.expandable_segments, conf.max_split_size_bytes) == (True, 2 ** 64 - 1)
    conf = alloc_conf_from_environment({"PYTORCH_ALLOC_CONF": "max_split_size_mb:64"})
    assert conf.max_split_size_bytes == 64 * MiB
    assert alloc_conf_from_environment({}) == AllocConf()
    with pytest.raises(ValueError, match="PYTORCH_CUDA_ALLOC_CONF 'max_split_size_mb:1'"):
        alloc_conf_from_environment({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:1"})


def test_as_alloc_conf_takes_none_a_string_or_a_parsed_conf() -> None:
    parsed = parse_alloc_conf("expandable_segments:True")
    assert as_alloc_conf(None) == AllocConf()
    assert as_alloc_conf("expandable_segments:True") == parsed
    assert as_alloc_conf(parsed) is parsed
    with pytest.raises(ValueError, match="alloc_conf must be None, a string .* got 42"):
        as_alloc_conf(42)
