"""Where a full fine-tune's fragmentation comes from: Llama-3.1-8B in bf16, 2 x 8192 tokens,
reentrant checkpointing, AdamW, on an H100 (docs/allocator.md, "A long-context step's
fragmentation").

The step's three largest blocks are the loss's fp32 logits ([2, 8192, 128256] fp32, 7.83 GiB:
transformers' `ForCausalLMLoss` upcasts before the cross-entropy; its log-softmax and their
gradients are as large). Step 1's optimizer step then makes AdamW's state (`_init_group`'s
`zeros_like`, lazily) while those blocks lie free in the cache, and the caching allocator's
best fit carves the state out of them; step 2's logits find no 7.83 GiB hole left and need
segments of their own. The same timeline with a bf16 loss (no upcast: the published run's own
loss), with `max_split_size_mb` (no block above it is split) or with expandable segments does not
fragment so. The loss is changed for real (transformers' loss mapping), nothing is mocked.
"""

from __future__ import annotations

import inspect
import json
import os

import pytest

from trainer_memcb.cli import main

pytestmark = pytest.mark.slow  # four plans of an 8B step, about 10 s each

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LLAMA_31_8B = os.path.join(ROOT, "examples", "models", "llama-3.1-8b")
GiB = 2**30


def _plan(tmp_path, capsys, *extra: str) -> dict:
    args = tmp_path / "args.json"
    args.write_text(json.dumps({"gradient_checkpointing": True, "gradient_checkpointing_kwargs": {"use_reentrant": True},
                                "per_device_train_batch_size": 2, "optim": "adamw_torch"}))
    code = main(["estimate", LLAMA_31_8B, "--training-args", str(args), "--dtype", "bfloat16", "--seq-len", "8192",
                 "--gpu", "h100", *extra, "--json"])
    document = json.loads(capsys.readouterr().out)
    assert code == (0 if document["answers"]["fits"] else 3)
    return document


def _parts_in_segments_of(snapshot_path: str, size: int) -> list:
    """The plan's part of each allocated block, by segment, in the written snapshot's segments of
    `size` bytes (the part of a block: that of the last allocation at its address)."""
    from trainer_memcb.plan.device.snapshot_file import read_snapshot

    snapshot = read_snapshot(snapshot_path)
    last_part = {}
    for (action, address, _, _), part in zip(snapshot.device_traces[0], snapshot.plan_parts[0]):
        if action == "alloc":
            last_part[address] = part.split(": ")[-1]
    return [sorted({last_part[block.address] for block in segment.blocks if block.allocated})
            for segment in snapshot.segments if segment.total_size == size]


def test_the_fp32_logits_blocks_carved_by_the_optimizer_state_are_the_fragmentation(tmp_path, capsys, monkeypatch):
    written = str(tmp_path / "plan.pickle")
    default = _plan(tmp_path, capsys, "--write-snapshot", written)
    # The fp32 logits' segments (2 x 8192 x 128256 x 4 bytes, a whole number of 2 MiB pages) hold
    # AdamW's state at the end of step 2, three of them: carved out in step 1's optimizer step, so
    # step 2 made three more, free again at its end.
    assert sorted(_parts_in_segments_of(written, 2 * 8192 * 128256 * 4)) == [[]] * 3 + [["optimizer_state"]] * 3
    device = default["device"]
    # 74.85 GiB allocated at most, 102.60 GiB reserved: out of memory in step 2's forward.
    assert (device["allocator_allocated_peak_bytes"], device["reserved_peak_bytes"]) == (80_371_829_760, 110_169_686_016)
    assert device["out_of_memory_at"] == "step 2, forward" and default["answers"]["fits"] is False
    # No block above 512 MiB split: the state goes elsewhere, the logits' segments stay whole.
    split = _plan(tmp_path, capsys, "--alloc-conf", "max_split_size_mb:512")["device"]
    assert split["allocator_allocated_peak_bytes"] == 80_371_829_760
    assert (split["reserved_peak_bytes"], split["out_of_memory_at"]) == (84_590_723_072, None)
    expandable = _plan(tmp_path, capsys, "--alloc-conf", "expandable_segments:True")["device"]
    assert (expandable["reserved_peak_bytes"], expandable["out_of_memory_at"]) == (81_145_102_336, None)
    # transformers' loss without its upcast, as the published run's own bf16 loss.
    import transformers.loss.loss_utils as loss_utils

    source = inspect.getsource(loss_utils.ForCausalLMLoss)
    assert source.count("logits = logits.float()") == 1
    namespace: dict = {}
    exec(source.replace("logits = logits.float()", "pass"), vars(loss_utils), namespace)  # noqa: S102 (transformers' own source)
    monkeypatch.setitem(loss_utils.LOSS_MAPPING, "ForCausalLM", namespace["ForCausalLMLoss"])
    bf16_loss = _plan(tmp_path, capsys)["device"]
    assert (bf16_loss["allocator_allocated_peak_bytes"], bf16_loss["reserved_peak_bytes"]) == (80_371_829_760, 80_832_626_688)
    assert bf16_loss["out_of_memory_at"] is None
