"""The device the plan answers for: PyTorch's CUDA caching allocator, GPU presets and CUDA's kernels"""
