"""Public measured runs into the case library: every shipped CSV imports, rows read as published, bad rows refused.

The CSVs are the real public measurements rltune ships (``rltune/predict/public/``; their README says
where each came from). The malformed files are those same rows with one cell broken by the test.
"""

from __future__ import annotations

import csv
import io
from pathlib import Path

import pytest

from rltune.cli.main import main
from rltune.contracts.public_runs import PUBLIC_RUN_COLUMNS, read_public_runs
from rltune.errors import MalformedFileError
from rltune.predict.library import CaseLibrary, DuplicateCaseError
from rltune.predict.public import SHIPPED_DIR, device_name, import_public_runs, read_rows, shipped_cases
from rltune.predict.theory import case_step, known_stages, throughput_seconds

# file -> (rows, rows repeating an earlier row's measurement, usable, failed, left out as contradicting)
EXPECTED = {
    "nemo_rl.csv": (52, 0, 52, 0, 0),
    "prime_rl.csv": (60, 0, 42, 7, 11),
    "prime_rl_history.csv": (128, 59, 51, 7, 11),
    "easyr1.csv": (14, 0, 14, 0, 0),
    "torchtitan.csv": (20, 0, 20, 0, 0),
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_every_shipped_csv_reads_into_cases_with_failures_and_contradictions_kept(name):
    rows = read_rows(SHIPPED_DIR / name)
    unique = [r for r in rows if r.duplicate_of is None]
    total, dups, usable, failed, contradicting = EXPECTED[name]
    assert len(rows) == total
    assert len(rows) - len(unique) == dups
    assert sum(r.case.usable for r in unique) == usable
    assert sum(r.case.status == "failed" for r in unique) == failed
    assert sum(r.case.status == "ok" and bool(r.case.excluded) for r in unique) == contradicting
    for r in unique:
        assert r.case.public and r.case.provenance["file"] == name and r.case.provenance["row"] == r.run.row
        if r.case.status == "failed":
            assert r.case.excluded and not r.case.measured  # a failed run publishes nothing, and says why


def test_a_nemo_rl_row_keeps_its_setup_and_leaves_the_rest_unknown():
    row = read_rows(SHIPPED_DIR / "nemo_rl.csv")[4]  # Qwen3-235B, 128 H100, colocated sync, v0.4
    case = row.case
    assert (case.model, case.device, case.gpus, case.rl_mode, case.release) == ("Qwen3-235B", "H100", 128, "sync", "v0.4")
    assert case.provenance["commit"] == "cff17f83b"
    assert case.knobs["engine_tp"] == 16 and case.knobs["colocated"] is True
    # [TP,CP,EP,PP,VPP]=[2,2,16,8,n/a] beside the tp/pp/dp/ep columns 2/8/4/16
    assert (case.knobs["trainer_tp"], case.knobs["trainer_cp"], case.knobs["trainer_ep"], case.knobs["trainer_pp"]) == (2, 2, 16, 8)
    assert case.facts["active_params"] == 22e9 and case.facts["total_params"] == 235e9 and case.facts["moe"] == 1.0
    assert case.facts["sequence_tokens"] == 5671.0
    # the column is a cap on prompt + response (its notes say so): a context limit, and no answer cap is invented
    assert case.facts["context_limit_tokens"] == 8192.0 and "answer_cap_tokens" not in case.facts
    assert case.measured == {"step_s": 506.0, "tokens_per_s_per_gpu": 45.7}  # the stages stay unknown
    assert known_stages(case) == {"rollout": None, "training": None, "weight_sync": None}
    assert case_step(case) == 506.0


def test_malformed_layout_cells_stay_unknown():
    case = read_rows(SHIPPED_DIR / "nemo_rl.csv")[0].case  # Llama 8B: the source's 7-entry layout cell
    assert not {"trainer_tp", "trainer_pp", "trainer_cp", "trainer_ep"} & set(case.knobs)


def test_a_prime_rl_row_whose_two_step_times_disagree_is_left_out_with_the_reason():
    case = read_rows(SHIPPED_DIR / "prime_rl.csv")[0].case
    assert case.status == "ok" and not case.usable
    # step_s 9.2313 s against tokens_per_step / tokens_per_s = 32768 / 2414.1 = 13.573 s
    assert "9.2313" in case.excluded and "13.573" in case.excluded and f"x{13.573 / 9.2313:.2f}" in case.excluded
    failed = read_rows(SHIPPED_DIR / "prime_rl.csv")[13].case  # the OOM run
    assert failed.status == "failed" and "OutOfMemoryError" in failed.excluded


def test_trainer_benchmarks_have_no_rollout_and_torchtitan_is_timed_by_its_throughput():
    prime = read_rows(SHIPPED_DIR / "prime_rl.csv")[3].case  # Qwen3-0.6B full fine-tune, 65536 tokens, A6000
    assert prime.workload == "trainer_only" and known_stages(prime) == {"rollout": 0.0, "training": 52.7969, "weight_sync": 0.0}
    titan = read_rows(SHIPPED_DIR / "torchtitan.csv")[0].case  # Llama 8B, 8 GPUs, global batch 16 x 8192 tokens
    assert titan.facts["tokens_per_step"] == 16 * 8192
    assert titan.measured == {"tokens_per_s_per_gpu": 5762.0}
    assert throughput_seconds(titan) == pytest.approx(16 * 8192 / (5762.0 * 8))
    assert case_step(titan) == pytest.approx(16 * 8192 / (5762.0 * 8))
    cp = read_rows(SHIPPED_DIR / "torchtitan.csv")[5].case  # no global batch: local 1 x dp 2 x 131072 tokens
    assert cp.facts["tokens_per_step"] == 1 * 2 * 131072 and "derived" in cp.provenance


@pytest.mark.parametrize("gpu, name", [("H100-80GB (DGX-H100)", "H100"), ("GB200 (GB200-NVL72)", "GB200"), ("NVIDIA RTX A6000", "A6000"),
                                       ("H100-96GB-HBM2e (500W)", "H100-HBM2e"), ("NVIDIA B200", "B200"), ("L20 48GB", "L20"),
                                       ("Some New Card 9000", "Some-New-Card-9000")])
def test_gpu_names_map_to_the_datasheet(gpu, name):
    assert device_name(gpu) == name


def test_the_shipped_library_holds_each_measurement_once():
    cases = shipped_cases()
    assert len({c.run_id for c in cases}) == len(cases) == 52 + 69 + 14 + 20  # prime-rl: 60 baselines + 9 older measurements


# ---- the import command --------------------------------------------------------------------------

def _files(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in path.iterdir()} if path.exists() else {}


def test_import_writes_every_row_and_a_second_import_changes_nothing(tmp_path, capsys):
    lib = tmp_path / "cases"
    assert main(["library", "import", str(SHIPPED_DIR / "easyr1.csv"), "--library", str(lib)]) == 0
    cases = CaseLibrary(lib).load()
    assert len(cases) == 14 and {c.release for c in cases} == {"v0.3.0", "v0.3.2"}
    before = {k: v for k, v in _files(lib).items() if not k.startswith("_")}
    capsys.readouterr()
    assert main(["library", "import", str(SHIPPED_DIR / "easyr1.csv"), "--library", str(lib), "--json"]) == 0
    assert '"already_in_library": 14' in capsys.readouterr().out
    assert {k: v for k, v in _files(lib).items() if not k.startswith("_")} == before


def _broken(tmp_path: Path, row: int, column: str, value: str) -> Path:
    text = (SHIPPED_DIR / "easyr1.csv").read_text(encoding="utf-8")
    rows = list(csv.DictReader(io.StringIO(text)))
    rows[row - 1][column] = value
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=[c for c, _, _ in PUBLIC_RUN_COLUMNS], lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    path = tmp_path / "broken.csv"
    path.write_text(out.getvalue(), encoding="utf-8")
    return path


@pytest.mark.parametrize("column, value, says", [
    ("step_s", "fast", "expected a number, found 'fast'"),
    ("step_s", "nan", "expected a finite number"),
    ("step_s", "-3", "must not be negative"),
    ("gpus", "8.5", "expected a whole number"),
    ("gpus", "", "empty, and this column is required"),
    ("rl_mode", "whenever", "cannot tell the RL mode"),
    ("trainer_gpus", "16", "exceeds the job's gpus (8)"),
])
def test_a_malformed_row_is_one_line_naming_file_row_and_column_and_nothing_is_written(tmp_path, capsys, column, value, says):
    lib = tmp_path / "cases"
    assert main(["library", "import", str(SHIPPED_DIR / "torchtitan.csv"), "--library", str(lib)]) == 0
    before = _files(lib)
    path = _broken(tmp_path, 9, column, value)
    capsys.readouterr()
    assert main(["library", "import", str(path), "--library", str(lib)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"rltune: {path}: row 9 (line 10), column {column}: ") and says in lines[0]
    assert _files(lib) == before


def test_a_header_with_a_missing_or_unknown_column_is_refused(tmp_path):
    text = (SHIPPED_DIR / "easyr1.csv").read_text(encoding="utf-8")
    missing = tmp_path / "missing.csv"
    missing.write_text(text.replace("sync_s,", "", 1), encoding="utf-8")
    with pytest.raises(MalformedFileError, match="header, column sync_s: missing"):
        read_public_runs(missing)
    typo = tmp_path / "typo.csv"
    typo.write_text(text.replace("step_s,", "stpe_s,", 1), encoding="utf-8")
    with pytest.raises(MalformedFileError, match="did you mean 'step_s'"):
        read_public_runs(typo)
    short = tmp_path / "short.csv"
    lines = text.splitlines()
    short.write_text("\n".join([lines[0], lines[1].rsplit(",", 3)[0]]) + "\n", encoding="utf-8")
    with pytest.raises(MalformedFileError, match=r"row 1 \(line 2\): has \d+ cells, the header names 25 columns"):
        read_public_runs(short)


def test_a_run_id_the_library_holds_with_other_content_refuses_the_whole_import(tmp_path):
    import pyarrow.parquet as pq

    from rltune.contracts.cases import record_to_table
    from rltune.predict.library import case_file_name

    lib = CaseLibrary(tmp_path / "cases")
    lib.path.mkdir()
    # the library already holds row 2's run id, with another step time than the CSV publishes
    other = read_rows(SHIPPED_DIR / "easyr1.csv")[1].case
    other.measured["step_s"] = 999.0
    pq.write_table(record_to_table(other), lib.path / case_file_name(other.run_id))
    before = _files(lib.path)
    with pytest.raises(DuplicateCaseError, match=r"row 2 \(line 3\).*other content; nothing was imported"):
        import_public_runs(SHIPPED_DIR / "easyr1.csv", lib)
    assert _files(lib.path) == before


def test_eval_of_an_imported_library_scores_each_case_from_the_others(tmp_path, capsys):
    import json

    rows = (SHIPPED_DIR / "easyr1.csv").read_text(encoding="utf-8").splitlines()
    small = tmp_path / "easyr1-6.csv"
    small.write_text("\n".join(rows[:7]) + "\n", encoding="utf-8")  # the header and six real rows (v0.3.0)
    lib = tmp_path / "cases"
    assert main(["library", "import", str(small), "--library", str(lib)]) == 0
    capsys.readouterr()
    assert main(["eval", "--library", str(lib), "--out", str(tmp_path / "eval"), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)["scores"]
    assert summary["rule"] == "same_or_earlier" and summary["prior"] is False  # never its own runs as a prior
    step = summary["scores"]["EasyR1 assets/baselines.md"]["step"]
    assert step["count"] == 6 and 0 <= step["within_10pct_count"] <= 6 and step["range_sharpness"] >= 1.0
    body = json.loads((tmp_path / "eval" / "eval.json").read_text())
    forecasts = body["scores"]["rows"]
    assert {r["run_id"] for r in forecasts} == {c.run_id for c in CaseLibrary(lib).load()}
    for r in forecasts:
        assert r["run_id"] not in r["cases"]  # leave one out: a case never forecasts itself
        assert r["error_pct"] == pytest.approx(100 * (r["predicted"] - r["measured"]) / r["measured"], abs=1e-3)
    assert (tmp_path / "eval" / "eval.png").is_file()
