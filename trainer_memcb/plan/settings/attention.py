"""The attention implementations a plan traces by stand-in kernels: transformers' flash paths, and
which of the hub's kernels (`attn_implementation="org/repo"`) are flash-attn 2's own, and the GPUs
flash_attention_3 is planned on.

A settings-layer table, so that the batch (`plan.model.step_inputs`, the packed row's boundaries)
and the trace (`plan.step.flash_attn`) read the same names.
"""

from __future__ import annotations

import re
from typing import Optional, Tuple

__all__ = ["HUB_FLASH_ATTN_2", "PLANNED_FLASH", "fa3_refusal", "hub_kernel_repo", "is_flash_path",
           "is_planned_hub_flash"]

# The flash implementations planned, each by its stand-ins (`flash_attn_interface`'s for FA3).
PLANNED_FLASH = ("flash_attention_2", "flash_attention_3")

# The hub's kernels (transformers' `attn_implementation="org/repo[@revision]"`, loaded by
# `integrations/hub_kernels.py`) that are flash-attn 2's own kernels, planned by its stand-ins:
# kernels-community/flash-attn2 (the fallback of transformers 5 for flash_attention_2: its
# build.toml compiles flash-attn 2's csrc/flash_attn/flash_api.cpp, and its torch-ext
# flash_attn_interface.py is flash-attn 2's, the same autograd functions) and
# kernels-community/flash-attn (transformers 4.57's fallback for flash_attention_2, the same build
# under its first name).
HUB_FLASH_ATTN_2 = ("kernels-community/flash-attn2", "kernels-community/flash-attn")


def hub_kernel_repo(name: Optional[str]) -> Optional[str]:
    """The hub repository `name` asks for (`is_kernel`'s pattern, "org/repo[@revision][:function]",
    the revision dropped), None for a name that is not a hub kernel's.

    Examples:
        >>> hub_kernel_repo("kernels-community/flash-attn2@v4"), hub_kernel_repo("sdpa")
        ('kernels-community/flash-attn2', None)
    """
    if name is None or re.search(r"^[^/:]+/[^/:]+(?:@[^/:]+)?(?::[^/:]+)?$", name) is None:
        return None
    return name.split(":")[0].partition("@")[0].strip()


def is_planned_hub_flash(name: Optional[str]) -> bool:
    """Whether `name` asks for a hub kernel that is flash-attn 2's (`HUB_FLASH_ATTN_2`), planned by its stand-ins."""
    return hub_kernel_repo(name) in HUB_FLASH_ATTN_2


def is_flash_path(name: Optional[str]) -> bool:
    """Whether `name` runs transformers' flash path with planned stand-ins (the varlen kernel for a
    packed row): flash_attention_2, flash_attention_3 or a hub kernel of flash-attn 2's."""
    return name in PLANNED_FLASH or is_planned_hub_flash(name)


def fa3_refusal(compute_capability: Tuple[int, int]) -> Optional[str]:
    """Why flash_attention_3 is not planned on a GPU of `compute_capability`; None on Ampere/Ada
    (8.x: the sm80 build's kernels, sm86 tile sizes on 8.6 and 8.9) and Hopper (9.0): flash-attn
    3.0.0 (`hopper/`) refuses a GPU older than Ampere and builds none for Blackwell (sm_80 and sm_90a
    machine code, no PTX a newer GPU could compile).

    Examples:
        >>> fa3_refusal((8, 6)) is None and fa3_refusal((9, 0)) is None
        True
    """
    cc = tuple(compute_capability)
    if cc < (8, 0):
        return "flash-attn 3 refuses it (\"FlashAttention only supports Ampere GPUs or newer.\", flash_api.cpp)"
    if cc[0] != 8 and cc != (9, 0):
        return "flash-attn 3's build has no kernels for it (hopper/setup.py compiles sm80 and sm90a code only)"
    return None
