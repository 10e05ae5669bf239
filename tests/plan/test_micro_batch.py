"""The per-device batch of a step's settings and the settings at another
(`trainer_memcb.plan.settings.micro_batch`): rows for the Trainer's step and a padded SFT step, one
row of batch x seq_len tokens for TRL's padding-free SFT step, which the searches resize."""

from __future__ import annotations

from trainer_memcb.plan.settings import resolve_settings
from trainer_memcb.plan.settings.micro_batch import per_device_batch, settings_at_batch
from trainer_memcb.plan.step.sft import SftStep


def test_a_padding_free_sft_step_resizes_its_one_row() -> None:
    packed = resolve_settings(None, batch_size=1, seq_len=32, packing=64,
                              preference=SftStep(max_length=32, padding_free=True))
    assert per_device_batch(packed) == 2
    at_five = settings_at_batch(packed, 5)
    assert (at_five.batch_size, at_five.packing, per_device_batch(at_five)) == (1, 160, 5)


def test_rows_change_the_batch_alone() -> None:
    for preference in (None, SftStep(max_length=32)):
        rows = resolve_settings(None, batch_size=3, seq_len=32, preference=preference)
        at_five = settings_at_batch(rows, 5)
        assert (per_device_batch(rows), at_five.batch_size, at_five.packing) == (3, 5, None)
