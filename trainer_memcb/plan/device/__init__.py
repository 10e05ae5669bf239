"""The device the plan answers for: PyTorch's CUDA caching allocator, GPU presets and CUDA's kernels.

`caching_allocator` replays a timeline of allocations and frees through a model of PyTorch's
`CUDACachingAllocator` (reserved bytes, segments, the out-of-memory path); `alloc_conf` reads
`PYTORCH_CUDA_ALLOC_CONF` as torch's own parser does. Imports nothing else from the plan.
"""
