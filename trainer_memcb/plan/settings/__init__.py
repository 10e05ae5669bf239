"""The plan's first stage: the settings, resolved once and handed down, never re-read.

`step_settings` resolves the step's settings from the `TrainingArguments`, the engine's config
file and the flags, each value with where it came from; `setup` holds the job's `Setup` (world
size, sharding, precision, offload) and the precisions; `optim_options` parses the Trainer's
`optim_args` and target-module lists.
"""

from trainer_memcb.plan.settings.step_settings import (MAX_SETTINGS_FILE_BYTES, SettingsFileError, StepSettings,
                                                      check_training_args, read_json_file, resolve_settings)

__all__ = ["StepSettings", "SettingsFileError", "resolve_settings", "read_json_file", "check_training_args",
           "MAX_SETTINGS_FILE_BYTES"]
