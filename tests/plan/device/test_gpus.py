"""The GPU presets: every card the issue names, figures held to the bytes their sources printed."""

from __future__ import annotations

import pytest

from trainer_memcb.plan.device.gpus import GPU_PRESETS, gpu_preset, gpu_presets
from trainer_memcb.plan.settings import StepSettings

MiB = 1024**2


def test_every_named_card_has_a_preset_in_order() -> None:
    assert [p.name for p in gpu_presets()] == [
        "H100", "H200", "A100-40GB", "A100-80GB", "L40S", "L4", "A10G", "RTX-4090", "RTX-3090", "T4",
        "V100-16GB", "V100-32GB"]


@pytest.mark.parametrize("name, total, cc, arch", [
    ("H100", 85_045_477_376, (9, 0), "Hopper"),
    ("H200", 143_156 * MiB, (9, 0), "Hopper"),
    ("A100-40GB", 42_405_855_232, (8, 0), "Ampere"),
    ("A100-80GB", 85_100_068_864, (8, 0), "Ampere"),
    ("L40S", 47_803_596_800, (8, 9), "Ada Lovelace"),
    ("L4", 23_570_219_008, (8, 9), "Ada Lovelace"),
    ("A10G", 22_587 * MiB, (8, 6), "Ampere"),
    ("RTX-4090", 25_386_352_640, (8, 9), "Ada Lovelace"),
    ("RTX-3090", 25_327_697_920, (8, 6), "Ampere"),
    ("T4", 15_843_721_216, (7, 5), "Turing"),
    ("V100-16GB", 16_945_512_448, (7, 0), "Volta"),
    ("V100-32GB", 34_089_730_048, (7, 0), "Volta"),
])
def test_each_preset_holds_its_sources_figures(name, total, cc, arch) -> None:
    preset = gpu_preset(name)
    assert (preset.total_bytes, preset.compute_capability, preset.architecture) == (total, cc, arch)


def test_the_cuda_context_per_card() -> None:
    contexts = {p.name: p.cuda_context_bytes // MiB for p in GPU_PRESETS}
    assert contexts == {"H100": 426, "H200": 426, "A100-40GB": 426, "A100-80GB": 426, "L40S": 426, "L4": 426,
                        "A10G": 426, "RTX-4090": 426, "RTX-3090": 256, "T4": 426, "V100-16GB": 426,
                        "V100-32GB": 426}
    assert gpu_preset("H100").usable_bytes == 85_045_477_376 - 426 * MiB


def test_every_figure_names_its_source() -> None:
    for preset in GPU_PRESETS:
        assert "bytes" in preset.total_source or "MB" in preset.total_source, preset.name
        assert "http" in preset.context_source, preset.name


@pytest.mark.parametrize("spelling", ["h100", "H100", " h100-80gb ", "H100_SXM", "NVIDIA H100 80GB HBM3"])
def test_names_are_case_insensitive_and_take_aliases(spelling) -> None:
    assert gpu_preset(spelling).name == "H100"


@pytest.mark.parametrize("spelling, name", [("rtx4090", "RTX-4090"), ("3090", "RTX-3090"), ("tesla t4", "T4"),
                                            ("a100_80gb", "A100-80GB"), ("V100-SXM2-32GB", "V100-32GB")])
def test_other_aliases(spelling, name) -> None:
    assert gpu_preset(spelling).name == name


def test_an_unknown_name_is_refused_with_the_allowed_ones() -> None:
    with pytest.raises(ValueError) as error:
        gpu_preset("h300")
    assert str(error.value) == (
        "unknown GPU 'h300'; choose one of H100, H200, A100-40GB, A100-80GB, L40S, L4, A10G, RTX-4090, "
        "RTX-3090, T4, V100-16GB, V100-32GB")


@pytest.mark.parametrize("name, sizes", [("A100", "A100-40GB, A100-80GB"), ("v100", "V100-16GB, V100-32GB")])
def test_a_name_of_two_sizes_is_refused_with_both(name, sizes) -> None:
    with pytest.raises(ValueError, match=f"GPU '{name}' is ambiguous: choose one of {sizes}"):
        gpu_preset(name)


def test_a_name_that_is_not_a_string_is_refused() -> None:
    with pytest.raises(ValueError, match="GPU name must be a string, got 100"):
        gpu_preset(100)  # type: ignore[arg-type]


@pytest.mark.parametrize("given, memory, context_mib, capability", [
    ({}, None, 426, (8, 0)),  # no GPU: an sm80 card's capability and the unmeasured context
    ({"gpu": "t4"}, 15_843_721_216, 426, (7, 5)),
    ({"gpu": "rtx3090"}, 25_327_697_920, 256, (8, 6)),
    ({"gpu": "h100", "device_memory": 40 * 1024**3}, 40 * 1024**3, 426, (9, 0)),  # the memory given wins
    ({"device_memory": 1_000_000}, 1_000_000, 426, (8, 0)),
])
def test_the_settings_read_their_device_from_the_preset_once(given, memory, context_mib, capability) -> None:
    settings = StepSettings(batch_size=1, seq_len=8, **given)
    assert settings.gpu_preset is (gpu_preset(given["gpu"]) if "gpu" in given else None)
    assert (settings.device_memory_bytes, settings.cuda_context_bytes // MiB, settings.compute_capability) == \
        (memory, context_mib, capability)
