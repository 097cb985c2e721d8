"""Many engine readers on one store: the CI-sized benchmark (N <= 4, tiny model) as a test of correctness.

Real processes (forked from a server that imported torch once), real files on local disk and on
/dev/shm, a real Qwen3 trained with AdamW: every reader's weights after every step must equal a
reference engine's loaded with the trainer's weights, byte for byte.
"""

from __future__ import annotations

import json
import random
import shutil
import time
from pathlib import Path

import pytest

from rltune.cli.main import main
from rltune.sync import format as fmt
from rltune.sync.bench.readers import (
    READERS_PRESET_DIR,
    ReadersBenchError,
    load_readers_config,
    readers_with_overrides,
    resolve_readers_preset,
    wait_for_step,
)
from rltune.sync.store import BroadcastStore


@pytest.fixture(scope="module")
def ci_run(tmp_path_factory):
    """``rltune sync-bench --readers 1,4 --preset ci``: disk and shm, 1 warm-up + 2 measured steps."""
    out = tmp_path_factory.mktemp("readers")
    code = main(["sync-bench", "--readers", "1,4", "--preset", "ci", "--out", str(out), "--quiet"])
    assert code == 0
    record = json.loads((out / "sync-readers.json").read_text())
    rows = [json.loads(line) for line in (out / "readers-rows.jsonl").read_text().splitlines()]
    return out, record, rows


def test_every_reader_verified_bit_for_bit_on_disk_and_shm(ci_run):
    _, record, _ = ci_run
    assert record["all_verified"] is True
    trials = {(t["storage"], t["readers"]): t for t in record["trials"]}
    assert set(trials) == {("disk", 1), ("disk", 4), ("shm", 1), ("shm", 4)}
    assert trials[("disk", 1)]["fs"] != "tmpfs" and trials[("shm", 1)]["fs"] == "tmpfs"
    for (_, n), t in trials.items():
        # the boot anchor and 3 delta steps (1 warm-up + 2 measured), on every reader
        assert t["updates"] == t["verified"] == n * 4
        assert t["read_before_complete"] == 0
        assert t["steps"] == 2
        assert 0 < t["changed_frac"]["min"] <= t["changed_frac"]["max"] < 0.2
        assert t["prefetch_s"]["min"] > 0 and t["read_s"]["min"] > 0 and t["decode_s"]["min"] > 0
        assert t["prefetch_s"]["min"] >= t["read_s"]["min"]
        assert t["prefetch_cpu_s"]["min"] > 0 and 0 < t["prefetch_cpu_share"]["median"] <= 1.5
        assert t["aggregate_GBps"]["min"] > 0 and t["publish_s"]["min"] > 0
        assert t["load"]["start"] and t["load"]["end"]
    assert trials[("disk", 4)]["prefetch_over_one_reader"] > 0


def test_each_reader_read_every_byte_of_each_delta_once(ci_run):
    """TP=1 readers hold every tensor: a prefetch reads each part file's header and every entry, once."""
    _, _, rows = ci_run
    writer = {(r["storage"], r["readers"], r["step"]): r for r in rows if r["who"] == "writer"}
    readers = [r for r in rows if r["who"] == "reader" and r["phase"] == "delta"]
    assert len(readers) == (1 + 4) * 3 * 2
    for r in readers:
        w = writer[(r["storage"], r["readers"], r["step"])]
        # a delta step's directory: the part, the rank summary, the manifest and COMPLETE
        assert r["read_bytes"] == w["part_bytes"] < w["bytes"]
        assert r["changes"] == w["changes"]  # the engine applied exactly the elements the step changed
    by_step = {}
    for r in readers:
        by_step.setdefault((r["storage"], r["readers"], r["step"]), set()).add(r["read_bytes"])
    assert all(len(sizes) == 1 for sizes in by_step.values())  # every reader read the same bytes


def test_readers_waited_for_complete_steps_and_polled(ci_run):
    """The writer pauses before each publish, so readers find steps not yet complete and back off."""
    _, _, rows = ci_run
    writer = {(r["storage"], r["readers"], r["step"]): r for r in rows if r["who"] == "writer"}
    deltas = [r for r in rows if r["who"] == "reader" and r["phase"] == "delta"]
    assert sum(r["polls"] for r in deltas) > 0
    for r in deltas:
        # the reader saw the step after its COMPLETE marker was written (mtime: the kernel's coarse clock)
        assert r["seen_wall"] >= writer[(r["storage"], r["readers"], r["step"])]["complete_mtime"]
        assert r["start"] <= r["end"]


def test_wait_for_step_never_takes_a_step_without_its_marker(tmp_path):
    """A step directory holding every file but COMPLETE is not taken; once the marker lands, it is."""
    from sync_helpers import Trainer

    src = tmp_path / "src"
    tr = Trainer(src, interval=100)
    tr.pub.publish(0)
    tr.train_step()
    tr.pub.publish(1)
    root = tmp_path / "root"
    shutil.copytree(src / fmt.step_dir_name(0), root / fmt.step_dir_name(0))
    half = root / fmt.step_dir_name(1)
    shutil.copytree(src / fmt.step_dir_name(1), half)
    (half / fmt.COMPLETE_NAME).unlink()
    store = BroadcastStore(root)
    assert store.is_complete(0) and not store.is_complete(1)
    with pytest.raises(ReadersBenchError, match="step 1 not complete"):
        wait_for_step(store, 1, time.monotonic() + 0.05, 0.001, 0.01, rng=random.Random(0))
    shutil.copy(src / fmt.step_dir_name(1) / fmt.COMPLETE_NAME, half / fmt.COMPLETE_NAME)
    assert wait_for_step(store, 1, time.monotonic() + 5, 0.001, 0.01) == 0
    # a release marker (the cold-cache mode) holds a complete step back until it exists
    release = tmp_path / "release-1"
    with pytest.raises(ReadersBenchError):
        wait_for_step(store, 1, time.monotonic() + 0.03, 0.001, 0.01, release=release)
    release.touch()
    assert wait_for_step(store, 1, time.monotonic() + 5, 0.001, 0.01, release=release) == 0


def test_readers_presets_load_and_bad_input_names_file_and_field(tmp_path, capsys):
    presets = sorted(READERS_PRESET_DIR.glob("*.yaml"))
    assert {p.stem for p in presets} >= {"ci", "cpu"}
    for p in presets:
        load_readers_config(p)
    bad = tmp_path / "bad.yaml"
    text = resolve_readers_preset("ci").read_text().replace("readers: [1, 4]", "readers: [1, 400]")
    bad.write_text(text)
    assert main(["sync-bench", "--readers", "1", "--preset", str(bad)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(bad) in err[0] and "readers" in err[0] and "0..64" in err[0]
    assert main(["sync-bench", "--readers", "1,x", "--preset", "ci"]) == 2
    assert "--readers" in capsys.readouterr().err
    assert main(["sync-bench", "--readers", "1", "--storage", "nfs", "--preset", "ci"]) == 2
    assert "disk, shm" in capsys.readouterr().err
    with pytest.raises(ReadersBenchError, match="--poll-max-s"):
        readers_with_overrides(load_readers_config(resolve_readers_preset("ci")), poll_max_s=1e-4, poll_min_s=None)


def test_cold_cache_readers_released_with_the_next_publish_verify(tmp_path):
    """cache: cold evicts each step's pages, release: next_publish holds step s back until the writer publishes
    s + 1 (so the publish runs under the readers' load); the readers still verify every step."""
    cfg = readers_with_overrides(load_readers_config(resolve_readers_preset("ci")), readers=[2], storage=["disk"],
                                 cache=["cold"], release="next_publish", steps=2, warmup_steps=0, writer_pause_s=0.0)
    from rltune.sync.bench.readers import run_readers_bench

    result = run_readers_bench(cfg, Path(tmp_path))
    (trial,) = result.record["trials"]
    assert trial["cache"] == "cold" and trial["verified"] == trial["updates"] == 2 * 3
    rows = [json.loads(x) for x in result.rows_path.read_text().splitlines()]
    assert all(r["evicted_bytes"] > 0 for r in rows if r["who"] == "writer" and r["step"] > 0)
