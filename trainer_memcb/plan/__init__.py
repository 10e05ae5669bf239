"""Planning before training: what one process will hold, in stages, each a subpackage.

- `settings`: the step's settings, resolved once from the `TrainingArguments`, the engine's config
  and the flags, and handed down (`resolve_settings`); the job's `Setup` and its precisions.
- `model`: the model as the Trainer prepares it, on the meta device and then fake: its batch,
  quantization, adapters, the fake kernels and value reads a fake trace needs.
- `optimizers`: the optimizer as the Trainer builds it for an `optim` name, over the model's
  stand-ins, and the optimizer what-if.
- `device`: the device the step runs on (the caching allocator, the GPU presets).
- `step`: one training step traced under fake tensors, under the engine the settings name
  (`step.engines`); its one product is the timeline of the storages created and freed, each
  tagged by part (`step.timeline`).
- `answers`: what the user asks, read from the timeline and the settings, never from the trace's
  internals: the step's peak and its parts, the model states during the step and their layout over
  the processes, fits?, the largest batch, and the evaluation loop.

A stage imports only the stages above it in this list (`device` none of them), and the package
imports only `state` and `utils`; `tests/test_layers.py` holds both.
"""
