"""The traced step: one training step run under fake tensors, under the engine the settings name.

`trace` runs the step (`trace_step`); its one product is a `timeline.Timeline` of the storages
created and freed, each with its bytes, part and model state, and each phase's peak.
`live_storages` records them as the step runs; `engines` wraps the model as each engine does (one
process, DDP, FSDP2, DeepSpeed ZeRO); `eval_forward` traces one evaluation forward.
"""
