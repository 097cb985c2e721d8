"""The sync cost model: its rates trace to committed records, its outputs follow from them, bad input is one line."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from rltune.cli.main import main
from rltune.sync.estimate import (
    OUTPUTS,
    RATES_PATH,
    Iv,
    Range,
    bytes_per_change,
    entropy_bits,
    estimate,
    load_model_spec,
    load_rates,
)

ROOT = Path(__file__).resolve().parents[2]
PRESETS = ROOT / "presets" / "sync" / "estimate"
HEADLINE = ["qwen3-8b", "qwen3-30b-a3b", "qwen3-235b-a22b", "kimi-k2-1t"]


def _builder():
    spec = importlib.util.spec_from_file_location("build_sync_rates", ROOT / "bench" / "build_sync_rates.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def rates():
    return load_rates()


def test_shipped_rates_are_what_the_committed_records_give():
    builder = _builder()
    assert builder.render(builder.build()) == RATES_PATH.read_text(), \
        "rltune/sync/data/rates.yaml is stale: run bench/build_sync_rates.py"


def test_every_rate_names_existing_records_at_their_own_git_sha(rates):
    assert rates.rates_version >= 1 and rates.built_by == "bench/build_sync_rates.py"
    for name, rate in rates.rates.items():
        assert 0 <= rate.min <= rate.max, name
        assert rate.unit and rate.machine and rate.what and rate.sources, name
        for src in rate.sources:
            path = ROOT / src.record
            assert path.exists(), f"{name}: {src.record} is not in the repository"
            record = path.with_name("sync-bench.json") if path.suffix == ".parquet" else path
            sha = json.loads(record.read_text())["git_sha"]
            assert sha.startswith(src.git.removesuffix("-dirty")), f"{name}: {src.record} was measured at {sha}"


def test_intervals_and_bytes_per_change():
    a, b = Iv(1, 2), Iv(3, 5)
    assert (a + b, a * b, b / a, 10 / a) == (Iv(4, 7), Iv(3, 10), Iv(1.5, 5), Iv(5, 10))
    assert a.minimum(Iv(1.5, 1.5)) == Iv(1, 1.5) and a.maximum(0.5) == a
    assert entropy_bits(0.5) == pytest.approx(1.0) and entropy_bits(0.0) == 0.0
    # 1 % changed: the positions cost H(0.01)/0.01 = 8.08 bits a change
    assert bytes_per_change(0.01, 1.0, 0.0) == pytest.approx(1.01, abs=0.005)
    assert bytes_per_change(0.005, 1.0, 0.25) > bytes_per_change(0.04, 1.0, 0.25)


def _spec(**changes):
    base = load_model_spec(PRESETS / "qwen3-8b.yaml")
    return replace(base, **changes)


def test_a_dense_model_on_one_rank_by_hand(rates):
    """Every output of a small dense setup recomputed here from the rates file, at both ends."""
    spec = _spec(params_total=1e9, params_active=1e9, tensors=100, dtypes=["bf16"],
                 changed_fraction=Range(0.01, 0.02), trainer=replace(_spec().trainer, ranks=1),
                 engine=replace(_spec().engine, engines=2, workers=1, readers_per_node=8))
    out = estimate(spec, rates)["by_dtype"]["bf16"]["outputs"]
    r = rates.rates
    lo_payload = 1e9 * r["codec_over_bound"].min * (entropy_bits(0.01) / 8 + 0.01 * r["value_bytes_per_change"].min)
    hi_payload = 1e9 * r["codec_over_bound"].max * (entropy_bits(0.02) / 8 + 0.02 * r["value_bytes_per_change"].max)
    framing = 100 * r["entry_framing_bytes"].min
    assert out["delta_MiB"]["lo"] == pytest.approx((lo_payload + framing) / 2**20)
    assert out["delta_MiB"]["hi"] == pytest.approx((hi_payload + framing) / 2**20)
    assert out["changes_per_step_M"]["lo"] == pytest.approx(10.0) and out["changes_per_step_M"]["hi"] == pytest.approx(20.0)
    assert out["encode_s"]["lo"] == pytest.approx(1e7 / (r["encode_gpu_Mchanges_per_s"].max * 1e6))
    host_hi = (r["publish_per_call_ms"].max + 100 * r["publish_per_tensor_ms"].max) / 1e3
    write_hi = (hi_payload + framing) / (spec.storage.write_GBps.min * 1e9)
    assert out["commit_s"]["hi"] == pytest.approx(write_hi + host_hi)
    assert out["trainer_publish_s"]["hi"] == pytest.approx(out["encode_s"]["hi"] + out["commit_s"]["hi"])
    # two single-GPU engines on one node share one fetch of each part (node cache)
    assert out["storage_read_GB_per_step"]["hi"] == pytest.approx((hi_payload + framing) / 1e9)
    decode_lo = 1e7 / (r["decode_Mchanges_per_s"].max * 1e6) + r["prefetch_per_entry_ms"].min * 100 / 1e3
    fetch_lo = (lo_payload + framing) / (spec.storage.read_GBps.max * 1e9)
    assert out["engine_read_s"]["lo"] == pytest.approx(fetch_lo + decode_lo)
    apply_hi = r["apply_per_call_ms"].max / 1e3 + 2e7 * r["apply_ps_per_change"].max / 1e12
    update_hi = r["update_host_per_call_ms"].max / 1e3 + r["update_host_per_tensor_us"].max * 100 / 1e6
    assert out["dispatch_blocking_s"]["hi"] == pytest.approx(apply_hi + update_hi)
    assert out["anchor_GiB"]["lo"] == out["anchor_GiB"]["hi"] == pytest.approx(2e9 / 2**30)
    rate_lo = min(r["anchor_write_GBps"].min, spec.storage.write_GBps.min) * 1e9
    assert out["anchor_write_s"]["hi"] == pytest.approx(2e9 / rate_lo)
    assert out["anchor_per_step_s"]["hi"] == pytest.approx(out["anchor_write_s"]["hi"] / spec.anchor_interval)
    # a fresh single-GPU worker holds all 2 GB; it loads them at min(the anchor-load rate, its share of the read)
    load_hi = min(r["anchor_load_GBps"].max, spec.storage.read_GBps.max) * 1e9
    load_lo = min(r["anchor_load_GBps"].min, spec.storage.read_GBps.min) * 1e9
    assert out["anchor_load_s"]["lo"] == pytest.approx(2e9 / load_hi)
    assert out["anchor_load_s"]["hi"] == pytest.approx(2e9 / load_lo)


@pytest.mark.parametrize("name", HEADLINE)
def test_headline_estimates_are_ranges_for_bf16_and_fp8(name, rates):
    spec = load_model_spec(PRESETS / f"{name}.yaml")
    result = estimate(spec, rates)
    assert set(result["by_dtype"]) == {"bf16", "fp8"}
    for dtype, d in result["by_dtype"].items():
        assert set(d["outputs"]) == set(OUTPUTS)
        for out_name, o in d["outputs"].items():
            assert 0 <= o["lo"] <= o["hi"] and math.isfinite(o["hi"]), (name, dtype, out_name)
            assert o["unit"] == OUTPUTS[out_name][0]
    bf16, fp8 = (result["by_dtype"][d]["outputs"] for d in ("bf16", "fp8"))
    assert fp8["anchor_GiB"]["lo"] == pytest.approx(bf16["anchor_GiB"]["lo"] / 2)
    assert bf16["changes_per_step_M"]["lo"] == pytest.approx(spec.params_total * 0.005 / 1e6)
    assert result["inputs"] and all(v["sources"] for v in result["inputs"].values())


def test_the_model_moves_the_right_way(rates):
    base = _spec(dtypes=["bf16"])

    def out(spec):
        return estimate(spec, rates)["by_dtype"]["bf16"]["outputs"]

    o = out(base)
    more = out(replace(base, changed_fraction=Range(0.02, 0.08)))
    assert more["delta_MiB"]["lo"] > o["delta_MiB"]["lo"] and more["engine_read_s"]["hi"] > o["engine_read_s"]["hi"]
    ranks = out(replace(base, trainer=replace(base.trainer, ranks=16)))
    assert ranks["encode_s"]["hi"] == pytest.approx(o["encode_s"]["hi"] / 2)
    slow = out(replace(base, storage=replace(base.storage, write_GBps=Range(0.5, 0.5))))
    assert slow["commit_s"]["lo"] > o["commit_s"]["lo"]
    no_cache = out(replace(base, storage=replace(base.storage, node_cache=False)))
    assert no_cache["storage_read_GB_per_step"]["lo"] == pytest.approx(8 * o["storage_read_GB_per_step"]["lo"])
    moe = load_model_spec(PRESETS / "qwen3-235b-a22b.yaml")
    ep = estimate(moe, rates)["by_dtype"]["bf16"]
    tp = estimate(replace(moe, engine=replace(moe.engine, tp=8, ep=1)), rates)["by_dtype"]["bf16"]
    # TP workers decode every entry of every tensor; EP workers only their experts' (and the dense ones)
    assert tp["layout"]["decoded_fraction"] == 1.0 > ep["layout"]["decoded_fraction"]
    assert tp["outputs"]["engine_read_s"]["lo"] > ep["outputs"]["engine_read_s"]["lo"]


def test_published_checks_either_land_within_2x_or_name_their_cause(rates):
    checks = sorted((PRESETS / "checks").glob("*.yaml"))
    assert {p.stem for p in checks} >= {"seed-qwen3-30b-a3b", "seed-glm-4.5-air", "verl-qwen3-235b"}
    for path in checks:
        result = estimate(load_model_spec(path), rates)
        assert result["checks"], path
        for c in result["checks"]:
            lo, hi = c["predicted"]["lo"], c["predicted"]["hi"]
            assert c["within_2x"] == (hi >= c["published"]["min"] / 2 and lo <= c["published"]["max"] * 2)
            if not c["within_2x"]:
                assert c["cause"].strip(), f"{path.name}: {c['output']} misses by {c['ratio']:.1f}x and names no cause"


def test_cli_estimate_prints_a_table_and_json(capsys):
    assert main(["sync-bench", "--estimate", str(PRESETS / "qwen3-30b-a3b.yaml"), "--json"]) == 0
    captured = capsys.readouterr()
    result = json.loads(captured.out)
    assert result["kind"] == "rltune-sync-estimate" and set(result["by_dtype"]) == {"bf16", "fp8"}
    assert "trainer_publish_s" in captured.err and "dispatch_blocking_s" in captured.err


BAD = [
    ("changed_fraction: {min: 0.005, max: 0.04}", "changed_fraction: {min: 0.005, max: 0.9}", "changed_fraction"),
    ("tensors: 18867", "tensor: 18867", "tensor"),
    ("engine: {engines: 4, workers: 2, tp: 2,", "engine: {engines: 4, workers: 2, tp: 4,", "engine.tp"),
    ("step_s: {min: 6, max: 12}", "step_s: {min: 12, max: 6}", "step_s.max"),
    ("dtypes: [bf16, fp8]", "dtypes: [bf16, int4]", "dtypes[1]"),
    ("params_active: 3.3e9", "params_active: 3.3e12", "params_active"),
    ("tensors: 18867", "tensors: many", "tensors"),  # wrong type
    ("tensors: 18867", "tensors: 18867.5", "tensors"),
    ("params_total: 30.53e9", "params_total: .nan", "params_total"),
    ("changed_fraction: {min: 0.005, max: 0.04}", "changed_fraction: {min: 0.005, max: .inf}", "changed_fraction.max"),
    ("read_GBps: {min: 3.6, max: 12.5}", "read_GBps: {min: 0, max: 12.5}", "storage.read_GBps.min"),
    ("node_cache: true", "node_cache: yes please", "storage.node_cache"),
    ("trainer: {ranks: 8,", "trainer: {ranks: 0,", "trainer.ranks"),
    ("dtypes: [bf16, fp8]", "dtypes: bf16", "dtypes"),
]


@pytest.mark.parametrize("old,new,where", BAD)
def test_a_malformed_model_yaml_is_one_line_naming_file_and_field(tmp_path, capsys, old, new, where):
    text = (PRESETS / "qwen3-30b-a3b.yaml").read_text()
    assert old in text
    bad = tmp_path / "MODEL.yaml"
    bad.write_text(text.replace(old, new))
    assert main(["sync-bench", "--estimate", str(bad)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(bad) in err[0] and f": {where}:" in err[0], err


def test_malformed_yaml_and_a_missing_file_are_one_line_too(tmp_path, capsys):
    text = (PRESETS / "qwen3-30b-a3b.yaml").read_text()
    bad = tmp_path / "MODEL.yaml"
    bad.write_text(text.replace("tensors: 18867", "tensors: [18867"))
    assert main(["sync-bench", "--estimate", str(bad)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(bad) in err[0] and "line" in err[0] and "not valid YAML" in err[0], err
    bad.write_text("- 1\n")
    assert main(["sync-bench", "--estimate", str(bad)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "mapping" in err[0], err
    assert main(["sync-bench", "--estimate", str(tmp_path / "none.yaml")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no such file" in err[0], err


def test_each_output_names_the_rates_it_depends_on_and_which_are_cpu_only(rates):
    result = estimate(load_model_spec(PRESETS / "qwen3-235b-a22b.yaml"), rates)
    out = result["by_dtype"]["bf16"]["outputs"]
    assert out["encode_s"]["inputs"] == ["encode_gpu_Mchanges_per_s"]
    assert out["changes_per_step_M"]["inputs"] == [] and out["anchor_GiB"]["inputs"] == []
    assert set(out["delta_MiB"]["inputs"]) == {"codec_over_bound", "value_bytes_per_change", "entry_framing_bytes"}
    assert "decode_Mchanges_per_s" in out["engine_read_s"]["inputs"]
    assert "prefetch_per_entry_ms" in out["engine_read_s"]["inputs"]
    cpu = {n for n, r in rates.rates.items() if r.cpu_only}
    assert set(result["cpu_only_inputs"]) == cpu
    for name, o in out.items():
        assert set(o["cpu_only_inputs"]) == set(o["inputs"]) & cpu, name
    if cpu:  # a rate no H200 record measures yet: the outputs built on it say so
        assert any(o["cpu_only_inputs"] for o in out.values()) and any("CPU only" in n for n in result["notes"])
    assert out["encode_s"]["cpu_only_inputs"] == []


H200_HOST_SWEEP = ("publish_per_call_ms", "publish_per_tensor_ms", "prefetch_per_entry_ms", "update_host_per_call_ms",
                   "update_host_per_tensor_us")


H200_ANCHOR = "bench/results/sync_estimate_rates-h200-anchor-992d280.json"


def test_the_host_and_anchor_rates_are_the_h200_hosts_and_none_is_a_cpu_stand_in(rates):
    """bench/results/sync_estimate_rates-h200-e3265b8.json holds the framing and the host sweep, not the anchor
    section: the five host rates are its. The anchor write and load rates are the H200 host's anchor section
    (sync_estimate_rates-h200-anchor-992d280.json: 1 GiB, disk and tmpfs), so no rate is a CPU stand-in."""
    record = "bench/results/sync_estimate_rates-h200-e3265b8.json"
    for name in H200_HOST_SWEEP:
        r = rates.rates[name]
        assert r.machine == "H200 host" and [(s.record, s.git) for s in r.sources] == [(record, "e3265b8")], name
    assert [n for n, r in rates.rates.items() if r.cpu_only] == []
    anchor = json.loads((ROOT / H200_ANCHOR).read_text())["anchor"]
    for name, lo, hi in (("anchor_write_GBps", 0.274, 0.312), ("anchor_load_GBps", 0.198, 0.595)):
        r = rates.rates[name]
        assert r.machine == "H200 host" and [(s.record, s.git) for s in r.sources] == [(H200_ANCHOR, "992d280-dirty")]
        # the min and max over both storages' runs: 0.274-0.312 GB/s a trainer rank, 0.198-0.595 a fresh worker
        assert (r.min, r.max) == (min(w[name]["min"] for w in anchor.values()), max(w[name]["max"] for w in anchor.values()))
        assert r.min == pytest.approx(lo, abs=5e-4) and r.max == pytest.approx(hi, abs=5e-4), name
    # a per-call cost is at most a whole call at the sweep's smallest tensor count (32: 15.8-21.8 ms a publish,
    # 0.90-1.35 ms an update), whatever the least-squares line's intercept over 32-16,384 tensors says
    sweep = json.loads((ROOT / record).read_text())["overheads"]
    for name, key in (("publish_per_call_ms", "publish_s"), ("update_host_per_call_ms", "apply_s")):
        whole = max(min(w["rows"], key=lambda row: row["tensors"])[key]["median"] for w in sweep.values())
        assert 0 <= rates.rates[name].min <= rates.rates[name].max <= whole * 1e3 + 1e-9, name
    result = estimate(load_model_spec(PRESETS / "qwen3-30b-a3b.yaml"), rates)
    out = result["by_dtype"]["bf16"]["outputs"]
    for name in ("trainer_publish_s", "engine_read_s", "dispatch_blocking_s", "sync_critical_s", "anchor_write_s",
                 "anchor_load_s", "full_sync_s"):
        assert out[name]["cpu_only_inputs"] == [], name
    assert "anchor_load_GBps" in out["anchor_load_s"]["inputs"] and "anchor_write_GBps" in out["anchor_write_s"]["inputs"]
    assert result["cpu_only_inputs"] == [] and not any("CPU only" in n for n in result["notes"])


def test_an_h200_rates_record_replaces_the_cpu_stand_ins(tmp_path, monkeypatch):
    """Once bench/sync_estimate_rates.py --device cuda is recorded, the host rates are the H200 host's and no
    input of the model is CPU-only. (A CPU record relabelled as a GPU one stands in for it here.)"""
    builder = _builder()
    record = json.loads((ROOT / "bench" / "results" / builder.CPU_RATES).read_text())
    record.update(device="cuda", quick=False, git_sha="0123456789abcdef")
    (tmp_path / "sync_estimate_rates-h200-0123456.json").write_text(json.dumps(record))
    monkeypatch.setattr(builder, "H200_RATES_GLOB", str(tmp_path / "sync_estimate_rates-h200-*.json"))
    real_rel = builder.rel
    monkeypatch.setattr(builder, "rel", lambda p: str(p) if str(p).startswith(str(tmp_path)) else real_rel(p))
    data = builder.build()
    for name in ("publish_per_tensor_ms", "prefetch_per_entry_ms", "update_host_per_tensor_us",
                 "anchor_write_GBps", "anchor_load_GBps"):
        assert data["rates"][name]["machine"] == "H200 host", name
        assert data["rates"][name]["sources"][0]["git"] == "0123456", name
    assert not [n for n, r in data["rates"].items() if r["machine"] == "CPU"]
    path = tmp_path / "rates.yaml"
    path.write_text(builder.render(data))
    result = estimate(load_model_spec(PRESETS / "kimi-k2-1t.yaml"), load_rates(path))
    assert result["cpu_only_inputs"] == []
    assert all(not o["cpu_only_inputs"] for d in result["by_dtype"].values() for o in d["outputs"].values())


def test_published_output_must_be_an_estimate_output(tmp_path, capsys):
    text = (PRESETS / "checks" / "seed-qwen3-8b.yaml").read_text().replace("output: delta_MiB", "output: delta_mb", 1)
    bad = tmp_path / "MODEL.yaml"
    bad.write_text(text)
    assert main(["sync-bench", "--estimate", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "published[0].output" in err and "delta_MiB" in err


def test_the_estimate_imports_no_torch():
    code = "import sys, rltune.sync.estimate; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 0
