"""The traced step: one training step run under fake tensors, under the engine the settings name.

`trace` runs the step; `live_storages` records every storage created and freed; `engines` wraps
the model as each engine does (one process, DDP, FSDP2, DeepSpeed ZeRO).
"""
