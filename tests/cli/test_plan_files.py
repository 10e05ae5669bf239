"""`trainer-memcb estimate ... --write-snapshot FILE --write-html FILE`: the planned step written
out, read back by `trainer-memcb snapshot` to the plan's figures, and the page drawn in headless
chromium."""

from __future__ import annotations

import json
import os
import pathlib
import pickle
import re
import shutil
import subprocess
import sys

import pytest

from trainer_memcb.cli import main
from trainer_memcb.plan.device.snapshot_replay import replay_snapshot

from helpers import installed_version

ROOT = pathlib.Path(__file__).parents[2]
TINY = str(ROOT / "examples" / "models" / "tiny-distilbert")
STEP = ["estimate", TINY, "--batch-size", "2", "--seq-len", "8"]
RESERVED_PEAK = 33_554_432  # the tiny step's, two steps through the caching allocator
# On transformers 4.x (the oldest releases allowed) the tiny DistilBERT's step holds 4 bytes less at
# its peak and its snapshot one allocation fewer (a 0-dim scalar transformers 5 makes and keeps; not
# traced further).
OLDEST_TRANSFORMERS = installed_version("transformers") < (5,)
SCALAR = 0 if OLDEST_TRANSFORMERS else 4
EVENTS = 1612 if OLDEST_TRANSFORMERS else 1613  # with the memory-efficient backward's delta and workspace


def env() -> dict:
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
                HF_HUB_OFFLINE="1")


def test_the_command_writes_both_and_the_snapshot_reads_back_to_the_plan(tmp_path, capsys):
    snapshot, page = tmp_path / "plan.pickle", tmp_path / "plan.html"
    assert main([*STEP, "--json", "--write-snapshot", str(snapshot), "--write-html", str(page)]) == 0
    out, err = capsys.readouterr()
    document = json.loads(out)  # stdout is the document alone; what was written is said on stderr
    assert document["device"]["reserved_peak_bytes"] == RESERVED_PEAK
    # (other libraries' import chatter in this process aside)
    assert [line for line in err.splitlines() if line.startswith("trainer-memcb:")] == [
        f"trainer-memcb: wrote {snapshot}: the planned step's allocator replay as a memory snapshot ({EVENTS:,} events, "
        f"reserved peak 32.0 MiB (33,554,432); read it with trainer-memcb snapshot {snapshot})",
        f"trainer-memcb: wrote {page}: a page of the planned step (open it in a browser; it fetches nothing)"]
    assert sorted(os.listdir(tmp_path)) == ["plan.html", "plan.pickle"]  # no temporary file left
    [device] = replay_snapshot(snapshot).devices
    assert device.real == device.replayed and device.first_divergence is None
    assert device.real.reserved_peak_bytes == document["device"]["reserved_peak_bytes"]
    # `trainer-memcb snapshot FILE` reads it back, in this process, to the same figures.
    assert main(["snapshot", str(snapshot), "--json"]) == 0
    [read] = json.loads(capsys.readouterr().out)["devices"]
    assert read["real"] == read["replayed"] == {
        "reserved_peak_bytes": RESERVED_PEAK, "segments_created": 7, "segments_freed": 0}
    assert read["events"] == EVENTS and read["first_divergence"] is None
    text = page.read_text(encoding="utf-8")
    assert "reserved peak 32.0 MiB (33,554,432)" in text and 'id="peak-marker"' in text


def test_the_console_script_writes_a_snapshot_torch_reads(tmp_path):
    snapshot = tmp_path / "plan.pickle"
    done = subprocess.run([sys.executable, "-m", "trainer_memcb", *STEP, "--write-snapshot", str(snapshot)],
                          capture_output=True, text=True, env=env(), timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stderr.endswith(f"read it with trainer-memcb snapshot {snapshot})\n")
    read = subprocess.run([sys.executable, "-m", "trainer_memcb", "snapshot", str(snapshot)],
                          capture_output=True, text=True, env=env(), timeout=120)
    assert read.returncode == 0 and read.stderr == ""
    assert "real      32.0 MiB (33,554,432)                 7               0" in read.stdout
    assert "replayed  32.0 MiB (33,554,432)                 7               0" in read.stdout
    import torch.cuda._memory_viz as memory_viz

    with open(snapshot, "rb") as handle:
        data = pickle.load(handle)
    assert memory_viz.segments(data, format_flamegraph=lambda text: text)
    assert memory_viz.memory(data, format_flamegraph=lambda text: text)
    assert "Active Memory Timeline" in memory_viz.trace_plot(data)


def test_max_batch_size_alone_writes_the_largest_batch_found(tmp_path, capsys):
    snapshot = tmp_path / "plan.pickle"
    code = main(["estimate", TINY, "--seq-len", "8", "--max-batch-size", "--device-memory", "460MiB", "--json",
                 "--write-snapshot", str(snapshot)])
    assert code == 0
    largest = json.loads(capsys.readouterr().out)["answers"]["largest_batch"]
    found = next(batch for batch in largest["searched"] if batch["batch_size"] == largest["max_batch_size"])
    [device] = replay_snapshot(snapshot).devices
    assert device.real == device.replayed
    assert device.real.reserved_peak_bytes == found["reserved_peak_bytes"]


@pytest.mark.parametrize("argv,phrase", [
    (["estimate", TINY, "--write-snapshot", "{dir}/a.pickle"],
     "--write-snapshot writes the planned step: it needs the step plan (--batch-size or --max-batch-size)"),
    (["estimate", TINY, "--device-memory", "1GiB", "--write-html", "{dir}/a.html"],
     "--write-html writes the planned step: it needs the step plan"),
    ([*STEP, "--device-type", "cpu", "--write-snapshot", "{dir}/a.pickle"],
     "--device-type cpu has no such allocator"),
    ([*STEP, "--write-snapshot", "{dir}/missing/a.pickle"], "the folder {dir}/missing does not exist"),
    ([*STEP, "--write-html", "{dir}/link"], "--write-html {dir}/link is a symbolic link; not writing through it"),
    ([*STEP, "--write-html", "{dir}/same", "--write-snapshot", "{dir}/same"], "name the same file"),
])
def test_refused_before_anything_is_traced(tmp_path, capsys, argv, phrase):
    (tmp_path / "link").symlink_to(tmp_path / "target")
    argv = [part.replace("{dir}", str(tmp_path)) for part in argv]
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and phrase.replace("{dir}", str(tmp_path)) in err and len(err.splitlines()) == 1
    assert sorted(os.listdir(tmp_path)) == ["link"] and not (tmp_path / "target").exists()


def test_a_cpu_plan_draws_its_page_without_a_reserved_line(tmp_path, capsys):
    page = tmp_path / "plan.html"
    assert main([*STEP, "--device-type", "cpu", "--write-html", str(page)]) == 0
    text = page.read_text(encoding="utf-8")
    assert 'id="reserved-line"' not in text and "no caching allocator on this device type" in text
    assert f"peak 7.7 MiB ({8_059_856 + SCALAR:,}), step 2, optimizer step" in text


@pytest.fixture(scope="module")
def page(tmp_path_factory) -> pathlib.Path:
    from trainer_memcb.cli.plan_html import plan_html
    from trainer_memcb.plan.answers.plan_snapshot import step_series
    from trainer_memcb.plan.answers.step_memory import plan_step_memory
    from trainer_memcb.plan.optimizers.whatif import build_meta_model

    plan, _ = plan_step_memory(lambda: build_meta_model(TINY), batch_size=2, seq_len=8, optimizer="adamw_torch",
                               model_states=False)
    path = tmp_path_factory.mktemp("page") / "plan.html"
    path.write_text(plan_html(plan, step_series(plan)), encoding="utf-8")
    return path


def test_the_page_fetches_nothing(page):
    text = page.read_text(encoding="utf-8")
    assert "http://" not in text and "https://" not in text
    assert not re.search(r"""\b(src|href)\s*=""", text)  # no script, style, image or link loaded from anywhere
    assert not re.search(r"@import|url\(|fetch\(|XMLHttpRequest|import\(", text)


def _chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    return ""


@pytest.mark.skipif(not _chromium(), reason="no headless chromium on this machine (apt-get install chromium)")
def test_the_page_renders_in_headless_chromium(page, tmp_path):
    flags = [_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
             f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1200,800"]
    done = subprocess.run([*flags, "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    dom = done.stdout
    # The DOM after the page's script ran: the chart, each part stacked, the reserved line, the peak.
    for expected in ('id="chart"', 'id="reserved-line"', 'id="peak-marker"', 'id="reserved-peak-marker"',
                     f"peak 26.9 MiB ({28_213_200 + SCALAR:,}), step 2, optimizer step",
                     "reserved peak 32.0 MiB (33,554,432)", "step 1, forward", "step 2, backward",
                     "step 2, optimizer step"):
        assert expected in dom, expected
    for part in ("parameters", "gradients", "optimizer_state", "activations", "batch_and_buffers", "other",
                 "cuda_workspaces"):
        assert f'<polygon class="part" data-part="{part}"' in dom, part
    shot = tmp_path / "page.png"
    done = subprocess.run([*flags, f"--screenshot={shot}", page.as_uri()], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000
