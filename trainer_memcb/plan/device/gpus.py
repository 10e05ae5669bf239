"""The GPUs people fine-tune on: what a process on each can use, and what CUDA takes first.

Each preset gives three figures, each with its public source:

- `total_bytes`: the total that `torch.cuda.mem_get_info()` reports on the card (CUDA's
  `cudaMemGetInfo`), which is the same number as `torch.cuda.get_device_properties(0).total_memory`
  (`cudaDeviceProp.totalGlobalMem`, what CUDA's `deviceQuery` sample prints as "Total amount of
  global memory ... (N bytes)"): both were printed side by side as exactly 50,865,307,648 bytes
  on an RTX 6000 Ada (https://github.com/unslothai/unsloth-zoo/pull/1053). It is less than the
  card's marketed size and less than nvidia-smi's total, because the driver keeps part of the
  memory for itself; it also moves by a few MiB between driver versions and with ECC, so a
  figure here is the one its source printed, not a constant of the card.
- `compute_capability` and `architecture`: from the same printouts (CUDA Capability
  Major/Minor), named after NVIDIA's architecture.
- `cuda_context_bytes`: what the process holds on the device once CUDA is initialised and before
  the caching allocator has reserved anything (the driver's context and the kernels loaded
  lazily, `CUDA_MODULE_LOADING=LAZY`, PyTorch's default since 1.13,
  https://github.com/pytorch/pytorch/pull/86509). Where no public measurement on the card itself
  was found, the closest measurement is used and the note says so.

`gpu_preset(name)` finds a preset by its name or an alias, case-insensitively; a name that fits
two presets (`a100`, `v100`) is refused with the candidates, since the two sizes of one card
differ by half. `gpu_presets()` lists them all in the order `--gpu list` prints them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Tuple

__all__ = ["GpuPreset", "gpu_preset", "gpu_presets", "GPU_PRESETS",
           "DEFAULT_CUDA_CONTEXT_BYTES", "DEFAULT_COMPUTE_CAPABILITY"]

MiB = 1024**2  # bytes

# The CUDA context, measured (nvidia-smi's figure for a process that only initialised CUDA).
# RTX 6000 Ada, PyTorch 2.10.0+cu130: 426 MiB after `torch.cuda.mem_get_info(0)`, nothing
# allocated (https://github.com/unslothai/unsloth-zoo/pull/1053, "Live measurements").
_CONTEXT_ADA_MIB = 426
# RTX 3090, PyTorch 2.7.1+cu128, driver 610.43.03: "a flat 256 MiB" held by a process that made
# its context and allocated nothing (https://github.com/invoke-ai/InvokeAI/issues/9413).
_CONTEXT_RTX3090_MIB = 256
# Cards with no public measurement of their own: the larger of the two recent measurements
# above, so that the plan does not promise room that the context takes. PyTorch's maintainers
# put the lazily loaded context at "around 400MB" for CUDA >= 11.7
# (https://github.com/pytorch/pytorch/issues/109888) and "~300MB"
# (https://github.com/pytorch/pytorch/issues/107667).
_CONTEXT_UNMEASURED_MIB = _CONTEXT_ADA_MIB
# Without a GPU named: the CUDA context taken as the unmeasured cards' (426 MiB), so that a plan
# for an unnamed card does not promise room that the context takes.
DEFAULT_CUDA_CONTEXT_BYTES = _CONTEXT_UNMEASURED_MIB * MiB
# Without a GPU named, the kernels are those of compute capability 8.0 (A100): the cuBLAS
# workspaces of every card but Hopper's (`cublas_workspace_bytes`), and the attention backends
# of an Ampere card (`sdpa_backend`).
DEFAULT_COMPUTE_CAPABILITY = (8, 0)


@dataclass(frozen=True)
class GpuPreset:
    """One GPU as the plan sees it.

    Attributes:
        name: the preset's name, as `--gpu` takes it and `--gpu list` prints it.
        torch_name: the card's name as `torch.cuda.get_device_name()` prints it.
        aliases: other names `gpu_preset` accepts (lower case).
        total_bytes: the total `torch.cuda.mem_get_info()` reports on the card.
        compute_capability: (major, minor).
        architecture: NVIDIA's name for the architecture.
        cuda_context_bytes: the CUDA context a process holds there before allocating.
        context_source, total_source: where each figure comes from (a URL and what it printed,
            or how the figure was derived).
    """

    name: str
    torch_name: str
    aliases: Tuple[str, ...]
    total_bytes: int
    compute_capability: Tuple[int, int]
    architecture: str
    cuda_context_bytes: int
    context_source: str
    total_source: str

    @property
    def usable_bytes(self) -> int:
        """What the caching allocator can reserve: the total less the CUDA context."""
        return self.total_bytes - self.cuda_context_bytes


_ADA_CONTEXT = (_CONTEXT_ADA_MIB * MiB,
                "426 MiB measured on an RTX 6000 Ada (same architecture), PyTorch 2.10.0+cu130: "
                "https://github.com/unslothai/unsloth-zoo/pull/1053")
_UNMEASURED_CONTEXT = (_CONTEXT_UNMEASURED_MIB * MiB,
                       "no public measurement on this card found: the 426 MiB measured on an RTX 6000 "
                       "Ada with PyTorch 2.10.0+cu130 (https://github.com/unslothai/unsloth-zoo/pull/1053), "
                       "the larger of the recent measurements; PyTorch's maintainers say 'around 400MB' "
                       "for CUDA >= 11.7 (https://github.com/pytorch/pytorch/issues/109888)")

# Every deviceQuery printout below is CUDA's own sample (cuda-samples, deviceQuery.cpp) printing
# `cudaDeviceProp.totalGlobalMem` in bytes.
GPU_PRESETS: Tuple[GpuPreset, ...] = (
    GpuPreset(
        "H100", "NVIDIA H100 80GB HBM3", ("h100-80gb", "h100-sxm", "h100-80gb-hbm3"),
        85_045_477_376, (9, 0), "Hopper", *_UNMEASURED_CONTEXT,
        total_source="deviceQuery, driver 12.7 / runtime 12.4: '81106 MBytes (85045477376 bytes)', "
                     "https://github.com/thamada/nvidia-smi/blob/main/nvsim/H100SXMx8_deviceQuery.py"),
    GpuPreset(
        "H200", "NVIDIA H200", ("h200-141gb", "h200-sxm"),
        143_156 * MiB, (9, 0), "Hopper", *_UNMEASURED_CONTEXT,
        total_source="torch.cuda.get_device_properties(0) printed "
                     "'_CudaDeviceProperties(name='NVIDIA H200', major=9, minor=0, total_memory=143156MB, ...)' "
                     "(a public Modal example, src/llm/vllm/vlm/skywork_r1v.py); torch prints whole MiB "
                     "rounded down, so the bytes are 143156 MiB, at most 1 MiB below the card's"),
    GpuPreset(
        "A100-40GB", "NVIDIA A100-SXM4-40GB", ("a100-sxm4-40gb", "a100-40g"),
        42_405_855_232, (8, 0), "Ampere", *_UNMEASURED_CONTEXT,
        total_source="deviceQuery on an A100 40GB with NVLink: '40441 MBytes (42405855232 bytes)', "
                     "https://upb-pc2.atlassian.net/wiki/spaces/PC2DOK/pages/1900609/NVIDIA+A100+40GB+with+NVLINK"),
    GpuPreset(
        "A100-80GB", "NVIDIA A100-SXM4-80GB", ("a100-sxm4-80gb", "a100-80g"),
        85_100_068_864, (8, 0), "Ampere", *_UNMEASURED_CONTEXT,
        total_source="deviceQuery, driver 12.5 / runtime 12.4: '81158 MBytes (85100068864 bytes)', "
                     "https://github.com/thamada/nvidia-smi/blob/main/nvsim/A100SXMx4_deviceQuery.py"),
    GpuPreset(
        "L40S", "NVIDIA L40S", ("l40s-48gb",),
        47_803_596_800, (8, 9), "Ada Lovelace", *_ADA_CONTEXT,
        total_source="deviceQuery, driver 12.4 / runtime 12.4: '45589 MBytes (47803596800 bytes)', "
                     "https://github.com/thamada/nvidia-smi/blob/main/nvsim/L40S_deviceQuery.py"),
    GpuPreset(
        "L4", "NVIDIA L4", ("l4-24gb",),
        23_570_219_008, (8, 9), "Ada Lovelace", *_ADA_CONTEXT,
        total_source="deviceQuery, driver 12.4 / runtime 11.8: '22478 MBytes (23570219008 bytes)', "
                     "https://github.com/thamada/nvidia-smi/blob/main/gls/L4_deviceQuery.py"),
    GpuPreset(
        "A10G", "NVIDIA A10G", ("a10g-24gb",),
        22_587 * MiB, (8, 6), "Ampere", *_UNMEASURED_CONTEXT,
        total_source="torch.cuda.get_device_properties(0) printed "
                     "'_CudaDeviceProperties(name='NVIDIA A10G', major=8, minor=6, total_memory=22587MB, ...)' "
                     "with torch 2.15.0.dev+cu130 (public GitHub text); torch prints whole MiB rounded down, "
                     "so the bytes are 22587 MiB, at most 1 MiB below the card's"),
    GpuPreset(
        "RTX-4090", "NVIDIA GeForce RTX 4090", ("rtx4090", "4090", "geforce-rtx-4090"),
        25_386_352_640, (8, 9), "Ada Lovelace", *_ADA_CONTEXT,
        total_source="deviceQuery, driver 12.4 / runtime 12.4: '24210 MBytes (25386352640 bytes)', "
                     "https://github.com/thamada/nvidia-smi/blob/main/gls/RTX4090_deviceQuery.py"),
    GpuPreset(
        "RTX-3090", "NVIDIA GeForce RTX 3090", ("rtx3090", "3090", "geforce-rtx-3090"),
        25_327_697_920, (8, 6), "Ampere", _CONTEXT_RTX3090_MIB * MiB,
        total_source="deviceQuery, driver 12.6 / runtime 12.4: '24154 MBytes (25327697920 bytes)', "
                     "https://github.com/thamada/nvidia-smi/blob/main/gls/RTX3090_deviceQuery.py",
        context_source="256 MiB measured on an RTX 3090, PyTorch 2.7.1+cu128: "
                       "https://github.com/invoke-ai/InvokeAI/issues/9413"),
    GpuPreset(
        "T4", "Tesla T4", ("tesla-t4", "t4-16gb"),
        15_843_721_216, (7, 5), "Turing", *_UNMEASURED_CONTEXT,
        total_source="deviceQuery, driver 11.0 / runtime 10.0: '15110 MBytes (15843721216 bytes)', "
                     "https://chiemon.github.io/2024/12/25/%E6%98%BE%E5%8D%A1%E4%BF%A1%E6%81%AF.html; "
                     "Colab's T4 reports 'a total capacity of 14.75 GiB' "
                     "(https://github.com/hpcaitech/Open-Sora/issues/697)"),
    GpuPreset(
        "V100-16GB", "Tesla V100-SXM2-16GB", ("v100-sxm2-16gb", "tesla-v100-sxm2-16gb"),
        16_945_512_448, (7, 0), "Volta", *_UNMEASURED_CONTEXT,
        total_source="deviceQuery, driver 9.0 / runtime 9.0: '16160 MBytes (16945512448 bytes)' (public "
                     "GitHub text); other drivers print 16911433728 or 16928342016 bytes"),
    GpuPreset(
        "V100-32GB", "Tesla V100-SXM2-32GB", ("v100-sxm2-32gb", "tesla-v100-sxm2-32gb"),
        34_089_730_048, (7, 0), "Volta", *_UNMEASURED_CONTEXT,
        total_source="deviceQuery, drivers 11.2 and 11.4: '32510 MBytes (34089730048 bytes)' (public GitHub "
                     "text); PyTorch's out-of-memory message on this card reads '31.75 GiB total capacity' "
                     "(https://github.com/hiyouga/LlamaFactory/issues/182)"),
)

# Names that fit more than one preset: refused with the candidates.
_AMBIGUOUS: Dict[str, Tuple[str, ...]] = {
    "a100": ("A100-40GB", "A100-80GB"),
    "v100": ("V100-16GB", "V100-32GB"),
}


def _key(name: str) -> str:
    return "-".join(name.strip().lower().replace("_", " ").replace("-", " ").split())


def _index() -> Dict[str, GpuPreset]:
    index: Dict[str, GpuPreset] = {}
    for preset in GPU_PRESETS:
        for name in (preset.name, preset.torch_name, *preset.aliases):
            index[_key(name)] = preset
    return index


_INDEX = _index()


def gpu_presets() -> Tuple[GpuPreset, ...]:
    """Every preset, in the order `--gpu list` prints them."""
    return GPU_PRESETS


def gpu_preset(name: str) -> GpuPreset:
    """The preset called `name` (its name, an alias or the name torch prints; any case).

    Raises:
        ValueError: naming the bad name and the presets allowed; for `a100` or `v100`, the two
            sizes to choose from.

    Example:
        >>> gpu_preset("h100").total_bytes
        85045477376
    """
    if not isinstance(name, str):
        raise ValueError(f"GPU name must be a string, got {name!r}")
    key = _key(name)
    if key in _AMBIGUOUS:
        raise ValueError(f"GPU {name!r} is ambiguous: choose one of {', '.join(_AMBIGUOUS[key])}")
    preset = _INDEX.get(key)
    if preset is None:
        allowed = ", ".join(p.name for p in GPU_PRESETS)
        raise ValueError(f"unknown GPU {name!r}; choose one of {allowed}")
    return preset
