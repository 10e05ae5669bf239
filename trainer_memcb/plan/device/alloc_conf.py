"""`PYTORCH_CUDA_ALLOC_CONF` read as torch's own parser reads it.

Followed from torch 2.13's sources: `c10/core/AllocatorConfig.h` (`ConfigTokenizer`, the
defaults of `AcceleratorAllocatorConfig`), `c10/core/AllocatorConfig.cpp`
(`AcceleratorAllocatorConfig::parseArgs` and its `parse*` functions,
`AcceleratorAllocatorConfig::roundup_power2_divisions`), `c10/cuda/CUDAAllocatorConfig.h`
(`CUDAAllocatorConfig::instance`, `getKeys`) and `c10/cuda/CUDAAllocatorConfig.cpp`
(`CUDAAllocatorConfig::parseArgs`). The keys, their checks and the defaults are torch's; every
bad value is a `ValueError` that names it and says what is allowed, where torch raises its own
`c10::ValueError` / `RuntimeError`.

One difference, on purpose: torch's `ConfigTokenizer::checkToken` returns whether the `:` or `,`
it expects is there, and the parsers ignore that answer, so torch reads `max_split_size_mb,40`
as `max_split_size_mb:40`. Here a missing `:` or `,` is an error.

Before torch 2.9 the same keys were parsed by `CUDAAllocatorConfig::parseArgs` alone
(`c10/cuda/CUDAAllocatorConfig.cpp`); `large_segment_size_mb`, `per_process_memory_fraction`,
`graph_capture_record_stream_reuse`, `pinned_free_catch_all` and `throw_on_cudamalloc_oom` are
newer keys than torch 2.6, and `max_split_size_mb`'s floor there is 20 (`kLargeBuffer`), which is
also the floor here while `large_segment_size_mb` keeps its default.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import List, Mapping, Optional, Tuple, Union

__all__ = [
    "AllocConf",
    "ALLOC_CONF_ENV_VARS",
    "alloc_conf_from_environment",
    "as_alloc_conf",
    "parse_alloc_conf",
]

MiB = 1024 ** 2  # kMB in c10/core/AllocatorConfig.cpp
SIZE_MAX = 2 ** 64 - 1  # std::numeric_limits<size_t>::max(): "no limit" for max_split_size
K_MIN_LARGE_ALLOC = 10 * MiB  # kMinLargeAlloc, c10/core/AllocatorConfig.h
DEFAULT_LARGE_SEGMENT_SIZE = 20 * MiB  # large_segment_size_{20971520}, AllocatorConfig.h
# roundup_power2_divisions holds one entry per power-of-two interval from 1 MiB to 64 GiB:
# kRoundUpPowerOfTwoIntervals = 16, kRoundUpPowerOfTwoStart = 1 MB (AllocatorConfig.cpp).
ROUNDUP_INTERVALS = 16
_ROUNDUP_START_LOG2 = 20
PINNED_MAX_REGISTER_THREADS = 128  # CUDAAllocatorConfig::pinned_max_register_threads()

# The variables torch 2.13 reads, first set wins: CUDAAllocatorConfig::instance() reads
# PYTORCH_CUDA_ALLOC_CONF, then PYTORCH_ALLOC_CONF (c10/cuda/CUDAAllocatorConfig.h; ROCm builds
# also read PYTORCH_HIP_ALLOC_CONF in between). PYTORCH_ALLOC_CONF is the newer, device-generic
# name (Note [AcceleratorAllocatorConfig design], c10/core/AllocatorConfig.h).
ALLOC_CONF_ENV_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")

# AcceleratorAllocatorConfig::getMutableKeys (AllocatorConfig.cpp) and CUDAAllocatorConfig::getKeys
# (CUDAAllocatorConfig.h): any other key is "Unrecognized" in a CUDA build.
ACCELERATOR_KEYS = (
    "large_segment_size_mb",
    "max_split_size_mb",
    "max_non_split_rounding_mb",
    "garbage_collection_threshold",
    "roundup_power2_divisions",
    "expandable_segments",
    "pinned_use_background_threads",
)
CUDA_KEYS = (
    "backend",
    "release_lock_on_cudamalloc",
    "pinned_use_cuda_host_register",
    "release_lock_on_hipmalloc",
    "pinned_use_hip_host_register",
    "graph_capture_record_stream_reuse",
    "pinned_reserve_segment_size_mb",
    "pinned_num_register_threads",
    "per_process_memory_fraction",
    "pinned_free_catch_all",
    "throw_on_cudamalloc_oom",
)
KNOWN_KEYS = ACCELERATOR_KEYS + CUDA_KEYS
BACKENDS = ("native", "cudaMallocAsync")  # CUDAAllocatorConfig::parseAllocatorConfig
_BOOL_KEYS = (
    "expandable_segments",
    "pinned_use_background_threads",
    "release_lock_on_cudamalloc",
    "release_lock_on_hipmalloc",
    "pinned_use_cuda_host_register",
    "pinned_use_hip_host_register",
    "graph_capture_record_stream_reuse",
    "pinned_free_catch_all",
    "throw_on_cudamalloc_oom",
)


@dataclass(frozen=True)
class AllocConf:
    """The caching allocator's settings, as torch holds them after parsing (bytes, not MiB).

    Args:
        text: the string it was parsed from (`""`: torch's defaults).
        large_segment_size_bytes: the segment a request of 1 to 10 MiB gets, and the page of the
            large pool's expandable segments (`large_segment_size_mb`, 20 MiB by default).
        max_split_size_bytes: blocks this large or larger are never split (`max_split_size_mb`);
            `SIZE_MAX` (2**64 - 1) when unset, as in torch.
        max_non_split_rounding_bytes: how much larger than a request of at least
            `max_split_size_bytes` a cached unsplittable block may be and still serve it
            (`max_non_split_rounding_mb`; by default `large_segment_size_bytes`).
        garbage_collection_threshold: the fraction of the allowed memory above which cached
            blocks are reclaimed before a new segment is asked for (0: never).
        roundup_power2_divisions: the divisions for each power-of-two interval from 1 MiB to
            64 GiB (16 entries; 0 or 1: plain 512-byte rounding).
        expandable_segments: segments grow by mapping pages instead of one `cudaMalloc` each.
        per_process_memory_fraction: the fraction of the device the allocator may reserve.
        backend: `native` (the caching allocator modelled here) or `cudaMallocAsync`.
    """

    text: str = ""
    large_segment_size_bytes: int = DEFAULT_LARGE_SEGMENT_SIZE
    max_split_size_bytes: int = SIZE_MAX
    max_non_split_rounding_bytes: int = DEFAULT_LARGE_SEGMENT_SIZE
    garbage_collection_threshold: float = 0.0
    roundup_power2_divisions: Tuple[int, ...] = field(default=(0,) * ROUNDUP_INTERVALS)
    expandable_segments: bool = False
    per_process_memory_fraction: float = 1.0
    backend: str = "native"

    def divisions_for(self, size: int) -> int:
        """The power-of-two divisions for a request of `size` bytes.

        `AcceleratorAllocatorConfig::roundup_power2_divisions(size_t)`: the interval of
        floor(log2(size)), counted from 1 MiB (sizes below 2 MiB share the first entry), the
        last entry for 32 GiB and above.
        """
        index = max(size.bit_length() - 1 - _ROUNDUP_START_LOG2, 0)
        return self.roundup_power2_divisions[min(index, ROUNDUP_INTERVALS - 1)]


def _tokens(text: str) -> List[str]:
    """`ConfigTokenizer`'s tokens: `,`, `:`, `[` and `]` alone, whitespace dropped."""
    tokens: List[str] = []
    buffer = ""
    for char in text:
        if char in ",:[]":
            if buffer:
                tokens.append(buffer)
                buffer = ""
            tokens.append(char)
        elif not char.isspace():
            buffer += char
    if buffer:
        tokens.append(buffer)
    return tokens


_WHOLE = re.compile(r"\+?[0-9]+\Z")
_DECIMAL = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?\Z")


class _Reader:
    """Walks the tokens as the `parse*` functions do, raising `ValueError` on anything torch
    rejects (and on a missing `:` or `,`, which torch lets through)."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.tokens = _tokens(text)

    def fail(self, message: str) -> ValueError:
        return ValueError(f"PYTORCH_CUDA_ALLOC_CONF {self.text!r}: {message}")

    def at(self, index: int, what: str) -> str:
        if index >= len(self.tokens):
            raise self.fail(f"the config ends where {what} is expected")
        return self.tokens[index]

    def expect(self, index: int, token: str, after: str) -> None:
        found = self.at(index, f"{token!r} after {after!r}")
        if found != token:
            raise self.fail(f"expected {token!r} after {after!r}, found {found!r}")

    def whole(self, index: int, key: str) -> int:
        # ConfigTokenizer::toSizeT (std::stoull); a sign or trailing letters are refused here.
        token = self.at(index, f"the value of {key!r}")
        if not _WHOLE.match(token):
            raise self.fail(f"{key} must be a whole number of 0 or more, got {token!r}")
        return int(token)

    def decimal(self, index: int, key: str) -> float:
        # ConfigTokenizer::toDouble (std::stod)
        token = self.at(index, f"the value of {key!r}")
        if not _DECIMAL.match(token):
            raise self.fail(f"{key} must be a number, got {token!r}")
        return float(token)

    def boolean(self, index: int, key: str) -> bool:
        # ConfigTokenizer::toBool: exactly "True" or "False".
        token = self.at(index, f"the value of {key!r}")
        if token not in ("True", "False"):
            raise self.fail(f"{key} must be True or False (spelled so), got {token!r}")
        return token == "True"

    def skip(self, index: int) -> int:
        """ConfigTokenizer::skipKey: the index of the value, or of the `]` closing a list."""
        key = self.tokens[index]
        self.expect(index + 1, ":", key)
        index += 2
        if self.at(index, f"the value of {key!r}") != "[":
            return index
        while index + 1 < len(self.tokens) and self.tokens[index + 1] != "]":
            index += 1
        if index + 1 >= len(self.tokens):
            raise self.fail(f"the list of {key!r} has no closing ']'")
        return index + 1


def _power_of_two(value: int) -> bool:
    return value > 0 and value & (value - 1) == 0  # llvm::isPowerOf2_64


def _parse_divisions(reader: _Reader, index: int, divisions: List[int]) -> int:
    """AcceleratorAllocatorConfig::parseRoundUpPower2Divisions: `[MB:div,...,>:div]` or one
    number for every interval. Returns the index of its last token."""
    key = "roundup_power2_divisions"
    reader.expect(index + 1, ":", key)
    index += 2
    if reader.at(index, f"the value of {key!r}") != "[":
        value = reader.whole(index, key)
        if not _power_of_two(value):
            raise reader.fail(f"{key} must be a power of 2, got {value}")
        divisions[:] = [value] * ROUNDUP_INTERVALS
        return index
    first_value = True
    last_index = 0
    while True:
        index += 1
        token = reader.at(index, f"']' closing {key!r}")
        if token == "]":
            return index
        boundary_token = token
        reader.expect(index + 1, ":", boundary_token)
        value = reader.whole(index + 2, key)
        index += 2
        if value != 0 and not _power_of_two(value):
            raise reader.fail(
                f"{key}: the divisions must be a power of 2, or 0 to disable rounding, got {value}"
            )
        if boundary_token == ">":
            # every interval above the last one named
            for position in range(last_index + 1, ROUNDUP_INTERVALS):
                divisions[position] = value
        else:
            if not _WHOLE.match(boundary_token):
                raise reader.fail(
                    f"{key}: an interval is a power of 2 in MiB or '>', got {boundary_token!r}"
                )
            boundary = int(boundary_token)
            if not _power_of_two(boundary):
                raise reader.fail(
                    f"{key}: an interval must be a power of 2 (in MiB), got {boundary}"
                )
            position = min(boundary.bit_length() - 1, ROUNDUP_INTERVALS - 1)
            if first_value:
                # the first interval named also covers every interval below it
                for below in range(position):
                    divisions[below] = value
                first_value = False
            divisions[position] = value
            last_index = position
        following = reader.at(index + 1, f"']' closing {key!r}")
        if following != "]":
            reader.expect(index + 1, ",", f"{boundary_token}:{value}")
            index += 1


def parse_alloc_conf(text: str) -> AllocConf:
    """Parse a `PYTORCH_CUDA_ALLOC_CONF` string as torch 2.13 does (see the module docstring).

    Raises:
        ValueError: an unknown key, a bad value (naming it and what is allowed), or a malformed
            string.

    Example:
        >>> conf = parse_alloc_conf("expandable_segments:True,max_split_size_mb:128")
        >>> conf.expandable_segments, conf.max_split_size_bytes
        (True, 134217728)
    """
    if not isinstance(text, str):
        raise ValueError(
            f"an allocator config is a string like 'expandable_segments:True', got {text!r}"
        )
    reader = _Reader(text)
    tokens = reader.tokens
    # parseArgs reads large_segment_size_mb first: the floors of max_split_size_mb and
    # max_non_split_rounding_mb, and the latter's default, are the large segment's size.
    large_segment = DEFAULT_LARGE_SEGMENT_SIZE
    for index, token in enumerate(tokens):
        if token == "large_segment_size_mb" and (index == 0 or tokens[index - 1] == ","):
            reader.expect(index + 1, ":", token)
            value = reader.whole(index + 2, token)
            floor_mb = K_MIN_LARGE_ALLOC // MiB
            if value <= floor_mb:  # parseLargeSegmentSize: "must be > 10 MB"
                raise reader.fail(f"large_segment_size_mb must be more than {floor_mb}, got {value}")
            large_segment = min(value, SIZE_MAX // MiB) * MiB
    values = {
        "large_segment_size_bytes": large_segment,
        "max_non_split_rounding_bytes": large_segment,
    }
    divisions = [0] * ROUNDUP_INTERVALS
    index = 0
    while index < len(tokens):
        key = tokens[index]
        if key not in KNOWN_KEYS:
            allowed = ", ".join(sorted(KNOWN_KEYS))
            raise reader.fail(f"unrecognized key {key!r}; the keys are {allowed}")
        if key == "roundup_power2_divisions":
            index = _parse_divisions(reader, index, divisions)
        elif key == "large_segment_size_mb":
            index += 2  # read above
        else:
            reader.expect(index + 1, ":", key)
            index += 2
            _parse_value(reader, key, index, values, large_segment)
        if index + 1 < len(tokens):
            reader.expect(index + 1, ",", tokens[index])
            index += 1
        index += 1
    values["roundup_power2_divisions"] = tuple(divisions)
    return AllocConf(text=text, **values)


def _parse_value(reader: _Reader, key: str, index: int, values: dict, large_segment: int) -> None:
    if key in ("max_split_size_mb", "max_non_split_rounding_mb"):
        # parseMaxSplitSize / parseMaxNonSplitRoundingSize: at least the large segment's MiB.
        value = reader.whole(index, key)
        floor_mb = large_segment // MiB
        if value < floor_mb:
            raise reader.fail(f"{key} too small, must be >= {floor_mb}, got {value}")
        field_name = "max_split_size_bytes" if key == "max_split_size_mb" else (
            "max_non_split_rounding_bytes")
        values[field_name] = min(value, SIZE_MAX // MiB) * MiB
    elif key == "garbage_collection_threshold":
        value = reader.decimal(index, key)
        if not 0.0 < value < 1.0:  # parseGarbageCollectionThreshold
            raise reader.fail(f"garbage_collection_threshold must be in (0.0, 1.0), got {value!r}")
        values["garbage_collection_threshold"] = value
    elif key == "per_process_memory_fraction":
        value = reader.decimal(index, key)
        if not 0.0 <= value <= 1.0:  # parsePerProcessMemoryFraction
            raise reader.fail(f"per_process_memory_fraction must be in [0.0, 1.0], got {value!r}")
        values["per_process_memory_fraction"] = value
    elif key == "backend":
        token = reader.at(index, "the value of 'backend'")
        if token not in BACKENDS:  # parseAllocatorConfig
            raise reader.fail(f"unknown allocator backend {token!r}; options are native and "
                              "cudaMallocAsync")
        values["backend"] = token
    elif key in _BOOL_KEYS:
        flag = reader.boolean(index, key)
        if key == "expandable_segments":
            values["expandable_segments"] = flag
    elif key == "pinned_num_register_threads":
        value = reader.whole(index, key)
        if not _power_of_two(value):  # parsePinnedNumRegisterThreads
            raise reader.fail(f"{key} has to be a power of 2, got {value}")
        if value > PINNED_MAX_REGISTER_THREADS:
            raise reader.fail(f"{key} should be at most {PINNED_MAX_REGISTER_THREADS}, got {value}")
    elif key == "pinned_reserve_segment_size_mb":
        value = reader.whole(index, key)
        if value <= 0:  # parsePinnedReserveSegmentSize
            raise reader.fail(f"{key} has to be greater than 0, got {value}")


def as_alloc_conf(value: Union[None, str, AllocConf]) -> AllocConf:
    """An `AllocConf` from None (torch's defaults), a `PYTORCH_CUDA_ALLOC_CONF` string, or itself."""
    if value is None:
        return AllocConf()
    if isinstance(value, AllocConf):
        return value
    if isinstance(value, str):
        return parse_alloc_conf(value)
    raise ValueError(
        f"alloc_conf must be None, a string like 'expandable_segments:True' or an AllocConf, "
        f"got {value!r}"
    )


def alloc_conf_from_environment(environ: Optional[Mapping[str, str]] = None) -> AllocConf:
    """The settings a torch 2.13 process started with `environ` (default `os.environ`) uses:
    `PYTORCH_CUDA_ALLOC_CONF`, else `PYTORCH_ALLOC_CONF`, else torch's defaults."""
    environ = os.environ if environ is None else environ
    for name in ALLOC_CONF_ENV_VARS:
        if name in environ:
            return parse_alloc_conf(environ[name])
    return AllocConf()
