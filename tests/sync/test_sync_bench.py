"""rltune sync-bench: the CPU preset runs, its record is consistent, presets and config errors are checked."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from rltune.contracts.stages import read_stages
from rltune.errors import UnknownKeyError, WrongTypeError
from rltune.sync.bench import (
    PRESET_DIR,
    SyncBenchError,
    load_sync_bench_config,
    resolve_preset,
    run_sync_bench,
    summary_lines,
    with_overrides,
)

SYNC_PRESETS = sorted(PRESET_DIR.glob("*.yaml"))


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    """The CPU preset, shortened: 1 warm-up + 2 measured steps, an anchor at step 2."""
    cfg = with_overrides(load_sync_bench_config(resolve_preset("cpu")), steps=2, warmup_steps=1, anchor_interval=2)
    out = tmp_path_factory.mktemp("sync-bench")
    return cfg, out, run_sync_bench(cfg, out)


def test_plain_delta_coding_publishes_six_bytes_a_change_and_every_engine_verifies(tmp_path):
    cfg = with_overrides(load_sync_bench_config(resolve_preset("cpu")), steps=2, warmup_steps=1, transports=["sparse"],
                         delta_coding="plain")
    result = run_sync_bench(cfg, tmp_path)
    assert result.record["all_verified"] is True
    deltas = [r for r in result.rows if r["transport"] == "sparse" and not r["anchor"] and r["changes"] > 0]
    assert deltas and all(r["bytes"] >= 6 * r["changes"] for r in deltas)  # a u32 position and a bf16 difference


def test_cpu_record_is_consistent(cpu_run):
    cfg, out, result = cpu_run
    record = json.loads((out / "sync-bench.json").read_text())
    assert record == json.loads(json.dumps(result.record))
    assert record["all_verified"] is True and record["skipped"] == {}
    assert set(record["transports"]) == {"filesystem", "inprocess", "sparse"}
    cols = {name: entry["columns"] for name, entry in record["transports"].items()}
    for name, entry in record["transports"].items():
        assert entry["steps"] == 2 and entry["verified"] == entry["updates"] == 3
        assert entry["checksum_failures"] == 0
        c = cols[name]
        assert c["bytes"]["min"] > 0
        assert 0 < c["changed_frac"]["min"] <= c["changed_frac"]["max"] <= 1
        assert 0 < c["dispatch_blocking_s"]["min"] <= c["dispatch_blocking_s"]["median"] <= c["dispatch_blocking_s"]["max"]
        assert c["publish_s"]["min"] > 0
    # Every transport saw the same optimizer steps, so the same changed fraction.
    assert cols["sparse"]["changed_frac"] == cols["filesystem"]["changed_frac"] == cols["inprocess"]["changed_frac"]
    # A delta step (3) is far smaller than a full checkpoint; the anchor step (2) carries a full copy too.
    sparse_rows = {r["step"]: r for r in result.rows if r["transport"] == "sparse"}
    full_rows = {r["step"]: r for r in result.rows if r["transport"] == "filesystem"}
    assert sparse_rows[3]["bytes"] < full_rows[3]["bytes"] / 4
    assert sparse_rows[2]["anchor"] == 1.0 and sparse_rows[2]["bytes"] > sparse_rows[3]["bytes"]
    assert record["transports"]["sparse"]["anchor_steps"] == 1 and "anchor_extra_publish_s" in record["transports"]["sparse"]
    # The sparse engine applied exactly the elements the step changed (TP=1, untied model).
    params = record["model"]["params"]
    for row in sparse_rows.values():
        assert row["changes"] == round(row["changed_frac"] * params) and row["checksum_verified"] == 1.0
        assert row["diff_in_step_s"] > 0
    ratio = record["ratios"]["filesystem_over_sparse_dispatch_blocking"]
    assert ratio == pytest.approx(cols["filesystem"]["dispatch_blocking_s"]["median"]
                                  / cols["sparse"]["dispatch_blocking_s"]["median"])
    assert record["ratios"]["filesystem_over_sparse_bytes"] > 1
    assert record["device"]["torch"] and record["device"]["type"] == "cpu"
    assert "triton" in record["device"] and record["git_sha"]
    assert record["config"]["model"] == "tiny" and record["config"]["steps"] == 2


def test_cpu_parquet_has_one_row_per_step_and_transport(cpu_run):
    cfg, out, result = cpu_run
    table = read_stages(out / "sync-bench.parquet")
    assert table.num_rows == 3 * 3
    rows = table.to_pylist()
    assert sorted((r["transport"], r["step"]) for r in rows) == sorted(
        (t, s) for t in ("filesystem", "inprocess", "sparse") for s in (1, 2, 3))
    for r in rows:
        assert r["run_id"].endswith("/" + r["transport"]) and r["warmup"] == (r["step"] == 1)
        assert r["verified"] == 1.0 and r["step_s"] is None  # no rollout in the bench: no step time claimed
        assert r["weight_sync_s"] == pytest.approx(r["publish_s"] + r["dispatch_blocking_s"])
        assert (r["prefetch_s"] is None) == (r["transport"] != "sparse")
    assert load_sync_bench_config(out / "config.yaml") == cfg


def test_summary_lines_show_medians_per_transport(cpu_run):
    _, _, result = cpu_run
    lines = summary_lines(result.record)
    assert [line["transport"] for line in lines] == ["filesystem", "inprocess", "sparse"]
    sparse = lines[2]
    assert sparse["ok"] == "3/3" and sparse["read ms"] != "-"
    median_ms = result.record["transports"]["sparse"]["columns"]["dispatch_blocking_s"]["median"] * 1e3
    assert float(sparse["blocking ms"]) == pytest.approx(median_ms, abs=0.05)
    assert lines[0]["read ms"] == "-"


def test_cli_prints_the_table_and_json(tmp_path, capsys):
    from rltune.cli.main import main

    rc = main(["sync-bench", "--preset", "cpu", "--steps", "1", "--warmup-steps", "0", "--transports",
               "filesystem,sparse", "--out", str(tmp_path), "--json", "--quiet"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert "sync-bench cpu-tiny" in captured.err and "filesystem" in captured.err and "sparse" in captured.err
    assert "filesystem_over_sparse_dispatch_blocking" in captured.err
    record = json.loads(captured.out)
    assert record["all_verified"] is True and list(record["transports"]) == ["filesystem", "sparse"]
    assert (tmp_path / "sync-bench.parquet").exists()


def test_the_vllm_row_patches_a_real_engine_on_the_sparse_files_and_every_update_verifies(tmp_path):
    """The command as a user runs it, in its own process: an in-process vLLM engine leaves vLLM's
    process-wide state (its distributed group, caches) behind, which later tests must not inherit."""
    from vllm_helpers import vllm_skip_reason

    if vllm_skip_reason() is not None:
        pytest.skip(vllm_skip_reason())
    preset = tmp_path / "cpu-anchor-2.yaml"
    preset.write_text((PRESET_DIR / "cpu.yaml").read_text().replace("anchor_interval: 4", "anchor_interval: 2"))
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "rltune.cli.main", "sync-bench", "--preset", str(preset), "--steps", "2",
                           "--warmup-steps", "1", "--transports", "sparse", "--vllm", "--out", str(out), "--json",
                           "--quiet"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    record = json.loads(proc.stdout)
    table = pq.read_table(out / "sync-bench.parquet").to_pylist()
    rows = [r for r in table if r["transport"] == "sparse/vllm"]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["verified"] == 1.0 and r["checksum_verified"] == 1.0 for r in rows)
    assert all(r["changes"] > 0 and r["prefetch_s"] is not None for r in rows if r["step"] != 2)
    # the same files: what the vLLM row reads is what the sparse row published
    sparse = {r["step"]: r for r in table if r["transport"] == "sparse"}
    assert all(r["bytes"] == sparse[r["step"]]["bytes"] and r["publish_s"] == sparse[r["step"]]["publish_s"]
               for r in rows)
    assert record["all_verified"] is True and "sparse/vllm" in record["transports"]


def test_the_vllm_row_needs_the_sparse_transport(tmp_path):
    with pytest.raises(SyncBenchError, match="--vllm: the vLLM row takes the sparse transport's files"):
        with_overrides(load_sync_bench_config(resolve_preset("cpu")), transports=["filesystem"], vllm=True)


def test_dense_steps_published_full_are_reloaded_and_verified(tmp_path):
    from rltune.sync.bench import load_sync_bench_config, resolve_preset, run_sync_bench, with_overrides

    cfg = with_overrides(load_sync_bench_config(resolve_preset("cpu")), steps=2, warmup_steps=0,
                         transports=["sparse"], dense_fraction=0.001)
    result = run_sync_bench(cfg, tmp_path)
    assert result.record["all_verified"] is True
    rows = pq.read_table(tmp_path / "sync-bench.parquet").to_pylist()
    dense = [r for r in rows if r["changed_frac"] > 0.001]
    assert dense and all(r["bytes"] > 0.5 * max(x["bytes"] for x in rows) for r in dense)  # written full


def test_cli_unknown_preset_is_one_line_exit_2(tmp_path, capsys):
    from rltune.cli.main import main

    rc = main(["sync-bench", "--preset", "nosuch", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 2 and "presets/sync/nosuch.yaml" in err and "cpu" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("path", SYNC_PRESETS, ids=lambda p: p.name)
def test_every_sync_preset_loads(path):
    cfg = load_sync_bench_config(path)
    assert cfg.warmup_steps < cfg.steps + cfg.warmup_steps and {"filesystem", "sparse"} <= set(cfg.transports)


def test_presets_cover_ci_and_a_half_billion_parameter_model():
    from rltune.workload.model import count_parameters

    assert {p.stem for p in SYNC_PRESETS} >= {"cpu", "h200"}
    cpu, h200 = load_sync_bench_config(PRESET_DIR / "cpu.yaml"), load_sync_bench_config(PRESET_DIR / "h200.yaml")
    assert cpu.device == "cpu" and cpu.param_dtype == h200.param_dtype == "bfloat16"
    assert count_parameters(h200.model) >= 0.5e9
    assert h200.device == "cuda" and "nccl" in h200.transports


def test_misspelt_key_names_the_field(tmp_path):
    text = (PRESET_DIR / "cpu.yaml").read_text().replace("anchor_interval:", "anchor_intervall:")
    (tmp_path / "bad.yaml").write_text(text)
    with pytest.raises(UnknownKeyError, match="anchor_intervall: unknown key .did you mean 'anchor_interval'"):
        load_sync_bench_config(tmp_path / "bad.yaml")


def test_unknown_transport_in_a_preset_is_located(tmp_path):
    text = (PRESET_DIR / "cpu.yaml").read_text().replace("[filesystem, inprocess, sparse]", "[filesystem, rdma]")
    (tmp_path / "bad.yaml").write_text(text)
    with pytest.raises(WrongTypeError, match="transports: unknown transport 'rdma'"):
        load_sync_bench_config(tmp_path / "bad.yaml")


@pytest.mark.parametrize("transports, problem", [([], "at least one"), (["sparse", "sparse"], "twice"),
                                                 (["ipc"], "unknown transport 'ipc'")])
def test_bad_transport_override_is_refused(transports, problem):
    cfg = load_sync_bench_config(PRESET_DIR / "cpu.yaml")
    with pytest.raises(SyncBenchError, match=problem):
        with_overrides(cfg, transports=transports)


def test_resolve_preset_accepts_a_path_and_rejects_a_missing_file(tmp_path):
    assert resolve_preset(str(PRESET_DIR / "cpu.yaml")) == PRESET_DIR / "cpu.yaml"
    with pytest.raises(SyncBenchError, match="no such preset file"):
        resolve_preset(str(tmp_path / "missing.yaml"))


def test_unknown_differ_in_a_preset_is_located(tmp_path):
    (tmp_path / "bad.yaml").write_text((PRESET_DIR / "cpu.yaml").read_text() + "differ: cuda\n")
    with pytest.raises(WrongTypeError, match="differ"):
        load_sync_bench_config(tmp_path / "bad.yaml")


def test_triton_differ_on_a_cpu_without_the_interpreter_is_one_line(tmp_path, monkeypatch, capsys):
    from rltune.cli.main import main

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    (tmp_path / "p.yaml").write_text((PRESET_DIR / "cpu.yaml").read_text() + "differ: triton\n")
    rc = main(["sync-bench", "--preset", str(tmp_path / "p.yaml"), "--out", str(tmp_path / "out"), "--quiet"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1
    assert f"{tmp_path / 'p.yaml'}: differ: triton on a CPU" in err and "use auto" in err
    (tmp_path / "gpu.yaml").write_text((PRESET_DIR / "h200.yaml").read_text() + "differ: triton\n")
    cfg = load_sync_bench_config(tmp_path / "gpu.yaml")  # a GPU preset, then moved to the CPU
    with pytest.raises(SyncBenchError, match="^differ: triton on a CPU"):
        with_overrides(cfg, device="cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("differ", ["torch", "triton"])
def test_gpu_run_verifies_every_update(tmp_path, differ):
    cfg = with_overrides(load_sync_bench_config(PRESET_DIR / "cpu.yaml"), device="cuda", steps=2,
                         transports=["filesystem", "inprocess", "sparse"], differ=differ)
    result = run_sync_bench(cfg, Path(tmp_path))
    assert result.all_verified and result.record["device"]["type"] == "cuda"
    assert result.record["config"]["differ"] == differ
