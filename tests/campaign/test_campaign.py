"""Bad inputs of every class in issue 41 through every command: one clear line, the README's exit
code, no traceback, and every recorded file byte for byte as it was.

Paths in the argv are relative to the case's ``cwd`` inside the area (see conftest.py). Where an
input is in fact valid and the command rightly accepts it, the case says so in its ``note``.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
import yaml

from .kit import (
    BINARY,
    DEMO,
    NUMBER_VALUES,
    Case,
    assert_outcome,
    assert_records_intact,
    complete_lines,
    field_name,
    files_outside,
    generic_mutations,
    new_records,
    run_in_process,
    run_subprocess,
    set_path,
    snapshot,
)

CAND = "{candidate}"          # filled in from the fast chain's forecast
AUTO = ["--rounds", "1", "--trials", "1", "--per-round", "1", "--steps", "3", "--tuned-dir", "tuned", "--no-live"]
SUBPROCESS_TIMEOUT_S = 30


def _rel(rel: str) -> str:
    """An area-relative path, with the finished auto work dir's trial run filled in."""
    return rel.replace("{trial_dir}", _INFO.get("trial_dir") or "missing")


def _mutate_text(rel: str, fn):
    def prepare(area: Path) -> None:
        path = area / _rel(rel)
        path.write_bytes(fn(path.read_bytes()))
    return prepare


def _mutate_data(rel: str, dotted: str, value):
    def prepare(area: Path) -> None:
        path = area / _rel(rel)
        data = yaml.safe_load(path.read_text())
        set_path(data, dotted.replace("{cand_index}", str(_INFO["cand_index"])), value)
        path.write_text(yaml.safe_dump(data, sort_keys=False))
    return prepare


def _chain(*preps):
    def prepare(area: Path) -> None:
        for p in preps:
            p(area)
    return prepare


_INFO: dict = {}


# ---------------------------------------------------------------------------------------------------
# 1. YAML artifacts x {malformed, not a mapping, empty, binary, truncated, unknown key, duplicate key,
#    wrong type per field class, negative / NaN / inf / 1e300, empty strings, unknown enum, schema too
#    new, a file of another kind}, each through the commands that read it.

# (artifact label, area-relative file, duplicate line, file of another kind, commands [(label, cwd, argv, exit)])
JOB_IN = "inputs/job.yaml"


def _artifact_commands():
    return {
        "job": ("inputs/job.yaml", "name: a-second-name", "real/runs/base/diagnosis.yaml", [
            ("profile", ".", ["profile", "inputs/job.yaml", "--steps", "3", "--out", "new-run"]),
            ("propose", "fast", ["propose", "runs/base/diagnosis.yaml", "--job", "../inputs/job.yaml", "--out",
                                 "new-candidates.yaml"]),
        ]),
        "knowledge": ("inputs/knowledge.yaml", "problems: {}", "fast/job.yaml", [
            ("propose", "real", ["propose", "runs/base/diagnosis.yaml", "--job", str(DEMO), "--knowledge",
                                 "../inputs/knowledge.yaml", "--out", "new-candidates.yaml"]),
        ]),
        "diagnosis": ("real/runs/base/diagnosis.yaml", "limiting_stage: training", "real/runs/base/candidates.yaml", [
            ("propose", "real", ["propose", "runs/base/diagnosis.yaml", "--job", str(DEMO), "--out",
                                 "new-candidates.yaml"]),
        ]),
        "candidates": ("real/runs/base/candidates.yaml", "limiting_stage: training", "real/runs/base/diagnosis.yaml", [
            ("predict", "real", ["predict", "runs/base/candidates.yaml", "--library", "cases", "--out",
                                 "new-forecast.yaml"]),
        ]),
        "forecast": ("fast/runs/base/forecast.yaml", "baseline_step_s: 0.001", "fast/runs/base/candidates.yaml", [
            ("trial", "fast", ["trial", "runs/base/forecast.yaml", "--job", "job.yaml", "--candidate", CAND,
                               "--steps", "3", "--no-remeasure", "--library", "cases"]),
        ]),
        "verdict": ("auto/wd/{trial_dir}/verdict.yaml", "decision: keep", "fast/runs/base/diagnosis.yaml", [
            ("report", "auto", ["report", "wd", "--out", "new-report.html"]),
        ]),
        "workload-config": ("inputs/workload.yaml", "name: another-name", "fast/job.yaml", [
            ("workload-check", "inputs", ["workload", "check", "workload.yaml"]),
        ]),
        "estimate-model": ("inputs/estimate.yaml", "name: another-name", "fast/job.yaml", [
            ("sync-bench-estimate", "inputs", ["sync-bench", "--estimate", "estimate.yaml"]),
        ]),
        "reward-check-job": ("inputs/job.yaml", "name: a-second-name", "real/runs/base/diagnosis.yaml", [
            ("reward-check", "fast", ["reward-check", "../inputs/job.yaml", "--against", "learn.yaml", "--steps", "4",
                                      "--out", "new-rc"]),
        ]),
    }


# Field classes per artifact: (dotted path, value, label). {cand_index} is the trial's forecast entry.
FIELD_CASES = {
    "job": [
        ("name", "", "empty-string"), ("name", 5, "wrong-type-str"), ("model.name", "", "empty-string"),
        ("model.layers", "two", "wrong-type-int"), ("model.layers", -2, "negative-count"), ("model.layers", 0, "zero-count"),
        ("model.layers", 1e30, "float-for-int"), ("model.total_params", "big", "wrong-type-float"),
        ("model.moe", "yes", "wrong-type-bool"), ("model.dtype", "fp64", "unknown-enum"),
        ("workload.kind", "poetry", "unknown-enum"), ("workload.context_limit_tokens", 8, "context-below-answer-cap"),
        ("workload.temperature", -1, "negative"), ("gpus.count", -1, "negative-count"),
        ("knobs.micro_batch_size", -8, "negative-knob"), ("knobs.num_engines", 0, "zero-knob"),
        ("knobs.rl_mode", "semi_async", "unknown-enum-knob"), ("knobs.micro_batch_size", "abc", "wrong-type-knob"),
        ("launch.command", "rltune workload run", "wrong-type-list"), ("launch.command", [], "empty-list"),
        ("launch.launcher", "k8s", "unknown-enum"), ("launch.dialect", "yaml", "unknown-enum"),
        ("launch.timeout_s", -1, "negative"), ("limits", 5, "wrong-type-mapping"),
        ("limits.steps", 0, "zero-count"), ("limits.steps", 99999999999999999999999, "huge-int"),
        ("limits.warmup_steps", -1, "negative-count"), ("metrics.format", "csv", "unknown-enum"),
        *[("model.total_params", v, label) for label, v in NUMBER_VALUES],
        *[("limits.noise_pct", v, label) for label, v in NUMBER_VALUES],
        *[("launch.timeout_s", v, label) for label, v in NUMBER_VALUES if label != "negative"],
    ],
    "knowledge": [
        ("fixes.0.overrides", {"micro_batch_size": "/0"}, "divide-by-zero-override"),
        ("knobs.micro_batch_size.min", 300, "min-above-max"), ("knobs.micro_batch_size.type", "complex", "unknown-enum"),
        ("knobs.rl_mode.choices", "sync", "wrong-type-list"), ("fixes.0.moves", ["banana"], "unknown-enum"),
        ("fixes.0.problems", ["no_such_problem"], "unknown-reference"), ("fixes.0.conflicts", ["no_such_fix"], "unknown-reference"),
        ("fixes.0.overrides", {"no_such_knob": 1}, "unknown-knob"), ("fixes.0.id", "", "empty-string"),
        *[("knobs.micro_batch_size.max", v, label) for label, v in NUMBER_VALUES],
    ],
    "diagnosis": [
        ("limiting_stage", "banana", "unknown-enum"), ("rl_mode", "banana", "unknown-enum"),
        ("steps_used", "all", "wrong-type-list"), ("steps_used", [], "empty-list"), ("run_id", "", "empty-string"),
        ("source", 5, "wrong-type-str"), ("stages", 5, "wrong-type-mapping"),
        ("problems", [{"id": "x", "stage": "banana", "component": "trainer", "summary": "s", "severity": 1.0}], "unknown-enum"),
        *[("step_median_s", v, label) for label, v in NUMBER_VALUES],
        *[("stages.step_s.median_s", v, label) for label, v in NUMBER_VALUES],
        *[("stage_medians_s.rollout_s", v, label) for label, v in NUMBER_VALUES],
    ],
    "candidates": [
        ("candidates.0.overrides.rl_mode", "warp", "unknown-rl-mode"),
        ("candidates.0.overrides.micro_batch_size", -8, "negative-knob"),
        ("candidates.0.overrides.micro_batch_size", "abc", "wrong-type-knob"),
        ("baseline_knobs.micro_batch_size", -8, "negative-knob"), ("baseline_dir", "no/such/run", "missing-run-dir"),
        ("baseline_run", "", "empty-string"), ("job", "no-such-job.yaml", "missing-job"),
        ("candidates.0.fixes", "x", "wrong-type-list"), ("candidates.0.id", "", "empty-string"),
        ("limiting_stage", "banana", "unknown-enum"), ("candidates", "many", "wrong-type-list"),
    ],
    "forecast": [
        *[("forecasts.{cand_index}.step_s", v, label) for label, v in NUMBER_VALUES],
        *[("baseline_step_s", v, label) for label, v in NUMBER_VALUES],
        ("forecasts.{cand_index}.range_s", [2.0, 1.0], "range-reversed"), ("forecasts.{cand_index}.method", "banana", "unknown-enum"),
        ("forecasts.{cand_index}.limiting_stage", "banana", "unknown-enum"),
        ("forecasts.{cand_index}.overrides.rl_mode", "warp", "unknown-rl-mode"),
        ("forecasts.{cand_index}.overrides.micro_batch_size", -8, "negative-knob"),
        ("candidates_file", "no-such-candidates.yaml", "missing-file"), ("gate_pct", -50, "negative-gate"),
        ("forecasts.{cand_index}.candidate", "", "empty-string"), ("forecasts", "all", "wrong-type-list"),
    ],
    "verdict": [
        ("decision", "banana", "unknown-enum"), ("run_id", "", "empty-string"),
        *[("step_s", v, label) for label, v in NUMBER_VALUES], ("knobs", 5, "wrong-type-mapping"),
    ],
    "workload-config": [
        ("trainer.micro_batch_size", -8, "negative-count"), ("engine.num_engines", 0, "zero-count"),
        ("orchestrator.rl_mode", "banana", "unknown-enum"), ("orchestrator.steps", -1, "negative-count"),
        ("env.context_limit_tokens", 8, "context-below-answer-cap"), ("model.preset", "no-such-preset", "unknown-enum"),
        ("name", "", "empty-string"), ("trainer.packing", "yes", "wrong-type-bool"),
        *[("trainer.lr", v, label) for label, v in NUMBER_VALUES],
    ],
    "estimate-model": [
        ("tensors", -1, "negative-count"), ("changed_fraction.min", 0.5, "min-above-max"),
        *[("params_total", v, label) for label, v in NUMBER_VALUES],
    ],
    "reward-check-job": [("knobs.micro_batch_size", -8, "negative-knob")],
}


def _yaml_cases() -> list[Case]:
    cases = []
    for artifact, (rel, dup, other, commands) in _artifact_commands().items():
        file_name = Path(rel).name
        generic = generic_mutations(dup, None)
        if artifact == "reward-check-job":
            generic = [g for g in generic if g[0] in ("malformed-yaml", "binary-garbage", "duplicate-key", "empty-file")]
        for label, fn, fields in generic:
            for cmd, cwd, argv in commands:
                cases.append(Case(f"{artifact}-{label}-{cmd}", argv, 2, (file_name, *fields), _mutate_text(rel, fn),
                                  cwd=cwd))
        for cmd, cwd, argv in commands:
            cases.append(Case(f"{artifact}-file-of-another-kind-{cmd}", argv, 2, (file_name,),
                              lambda area, rel=rel, other=other: (area / _rel(rel)).write_bytes((area / other).read_bytes()),
                              cwd=cwd))
        for dotted, value, label in FIELD_CASES.get(artifact, []):
            for cmd, cwd, argv in commands:
                shown = dotted.replace(".{cand_index}", "").replace(".0.", ".")
                cases.append(Case(f"{artifact}-{shown}-{label}-{cmd}", argv, 2, (file_name, field_name(dotted)),
                                  _mutate_data(rel, dotted, value), cwd=cwd))
    return cases


def _job_input(area: Path) -> None:
    """inputs/job.yaml: the fast CPU demo job, which the job mutations start from."""
    (area / JOB_IN).write_bytes((area / "fast/job.yaml").read_bytes())


def _job_dup_knob(text: bytes) -> bytes:
    return text.replace(b"  micro_batch_size: 8\n", b"  micro_batch_size: 8\n  micro_batch_size: 16\n", 1)


def _more_job_cases() -> list[Case]:
    argv = ["profile", "inputs/job.yaml", "--steps", "3", "--out", "new-run"]
    return [
        Case("job-duplicate-knob-profile", argv, 2, ("job.yaml", "micro_batch_size"),
             _mutate_text(JOB_IN, _job_dup_knob)),
        Case("job-duplicate-knob-auto", ["auto", "inputs/job.yaml", "--workdir", "new-wd", *AUTO], 2,
             ("job.yaml", "micro_batch_size"), _mutate_text(JOB_IN, _job_dup_knob)),
        Case("job-nested-unknown-key-trial", ["trial", "runs/base/forecast.yaml", "--job", "../inputs/job.yaml",
                                              "--candidate", CAND, "--steps", "3", "--library", "cases"],
             2, ("job.yaml", "comand"), _mutate_data(JOB_IN, "launch.comand", ["x"]), cwd="fast"),
        Case("job-negative-knob-trial", ["trial", "runs/base/forecast.yaml", "--job", "../inputs/job.yaml",
                                         "--candidate", CAND, "--steps", "3", "--library", "cases"],
             2, ("job.yaml", "micro_batch_size"), _mutate_data(JOB_IN, "knobs.micro_batch_size", -8), cwd="fast"),
        Case("job-zero-engines-auto", ["auto", "inputs/job.yaml", "--workdir", "new-wd", *AUTO], 2,
             ("job.yaml", "num_engines"), _mutate_data(JOB_IN, "knobs.num_engines", 0)),
        Case("job-empty-name-auto", ["auto", "inputs/job.yaml", "--workdir", "new-wd", *AUTO], 2,
             ("job.yaml", "name"), _mutate_data(JOB_IN, "name", "")),
    ]


def _fix_yaml_case(case: Case) -> Case:
    if "inputs/job.yaml" in " ".join(case.argv) or "../inputs/job.yaml" in case.argv:
        inner = case.prepare
        case.prepare = _chain(_job_input, inner) if inner else _job_input
    return case


# ---------------------------------------------------------------------------------------------------
# 2. Parquet inputs: stage tables and case-library parts truncated, zero bytes, random bytes.

def _parquet_damage():
    def truncated(data: bytes) -> bytes:
        return data[: len(data) // 2]
    return [("truncated", truncated), ("zero-bytes", lambda d: b""), ("random-bytes", lambda d: os.urandom(2048)),
            ("text-file", lambda d: b"step,step_s\n0,1.0\n")]


def _first_case_part(area: Path, library: str) -> str:
    parts = sorted(p for p in (area / library).glob("*.parquet") if not p.name.startswith("_"))
    return parts[0].relative_to(area).as_posix()


def _damage_part(library: str, fn):
    def prepare(area: Path) -> None:
        path = area / _first_case_part(area, library)
        path.write_bytes(fn(path.read_bytes()))
    return prepare


def _parquet_cases() -> list[Case]:
    cases = []
    for label, fn in _parquet_damage():
        cases += [
            Case(f"stages-{label}-predict-records-baseline",
                 ["predict", "runs/base/candidates.yaml", "--library", "new-cases", "--new-library", "--out", "f.yaml"],
                 2, ("stages.parquet",), _mutate_text("real/runs/base/stages.parquet", fn), cwd="real"),
            Case(f"stages-{label}-trial-baseline",
                 ["trial", "runs/base/forecast.yaml", "--job", "job.yaml", "--candidate", CAND, "--steps", "3",
                  "--library", "cases"], 2, ("stages.parquet",), _mutate_text("fast/runs/base/stages.parquet", fn),
                 cwd="fast"),
            Case(f"stages-{label}-report-run", ["report", "wd", "--out", "new-report.html"], 2, ("stages.parquet",),
                 _mutate_text("auto/wd/{trial_dir}/stages.parquet", fn), cwd="auto"),
            Case(f"stages-{label}-auto-resume", ["auto", "job.yaml", "--workdir", "wd", *AUTO], 2, ("stages.parquet",),
                 _mutate_text("auto/wd/{trial_dir}/stages.parquet", fn), cwd="auto"),
            Case(f"case-part-{label}-predict", ["predict", "runs/base/candidates.yaml", "--library", "cases", "--out",
                                                "f.yaml"], 2, ("cases/",), _damage_part("real/cases", fn), cwd="real"),
            Case(f"case-part-{label}-eval", ["eval", "--library", "cases"], 2, ("cases/",),
                 _damage_part("real/cases", fn), cwd="real"),
            Case(f"case-part-{label}-trial", ["trial", "runs/base/forecast.yaml", "--job", "job.yaml", "--candidate",
                                              CAND, "--steps", "3", "--library", "cases"], 2, ("cases/",),
                 _damage_part("fast/cases", fn), cwd="fast"),
            Case(f"case-part-{label}-auto-resume", ["auto", "job.yaml", "--workdir", "wd", *AUTO], 2, ("cases/",),
                 _damage_part("auto/wd/cases", fn), cwd="auto"),
        ]
    # The index is a cache of the parts: a damaged one is rebuilt from them, which is valid after all.
    cases.append(Case("case-index-random-bytes-eval-rebuilds-it", ["eval", "--library", "cases"], 0, (),
                      _mutate_text("real/cases/_index.parquet", lambda d: os.urandom(512)), cwd="real",
                      may_change=("real/cases/_index.parquet",),
                      note="a damaged index is a cache, rebuilt from the case parts; nothing recorded is lost"))
    return cases


# ---------------------------------------------------------------------------------------------------
# 3. journal.jsonl of a finished work dir.

JOURNAL = "auto/wd/journal.jsonl"
RESUME = ["auto", "job.yaml", "--workdir", "wd", *AUTO]


def _journal_lines(area: Path) -> list[bytes]:
    return (area / JOURNAL).read_bytes().splitlines()


def _keeps_every_event(area: Path) -> None:
    import json

    events = [json.loads(line) for line in complete_lines((area / JOURNAL).read_bytes())]
    assert [e["event"] for e in events[: len(_INFO["events"])]] == [e["event"] for e in _INFO["events"]], (
        "the journal lost a complete event")


def _unfinished_without_newline(area: Path) -> None:
    """Cut the events after the last trial (round end, finish) and that trial's final newline."""
    lines = _journal_lines(area)
    last_trial = max(i for i, line in enumerate(lines) if b'"event": "trial"' in line)
    (area / JOURNAL).write_bytes(b"\n".join(lines[: last_trial + 1]))


def _keeps_every_event_but_finish(area: Path) -> None:
    import json

    kept = [json.loads(line)["event"] for line in complete_lines((area / JOURNAL).read_bytes())]
    wanted = [e["event"] for e in _INFO["events"]]
    last_trial = max(i for i, e in enumerate(wanted) if e == "trial")
    assert kept[: last_trial + 1] == wanted[: last_trial + 1], "the journal lost a complete event"


def _corrupt_middle(area: Path) -> None:
    lines = _journal_lines(area)
    lines[1] = b"this line is not JSON"
    (area / JOURNAL).write_bytes(b"\n".join(lines) + b"\n")


def _another_jobs_journal(area: Path) -> None:
    text = (area / JOURNAL).read_text().replace('"job_name": "campaign-auto"', '"job_name": "someone-elses-job"')
    (area / JOURNAL).write_text(text)


def _journal_cases() -> list[Case]:
    return [
        # An editor saves the last line without its newline: the event is complete and must be kept.
        Case("journal-last-line-without-newline-auto-resumes", RESUME, 0, (),
             _mutate_text(JOURNAL, lambda d: d.rstrip(b"\n")), cwd="auto", append_only=(JOURNAL,),
             may_change=("auto/wd/report.html", "auto/tuned/", "auto/wd/savings.yaml"), check=_keeps_every_event,
             note="valid: a complete last event without a final newline is still an event"),
        # The same, in a work dir that has not finished: the resume appends after that event.
        Case("journal-unfinished-last-line-without-newline-auto-resumes", RESUME, 0, (), _unfinished_without_newline,
             cwd="auto", append_only=(JOURNAL,),
             may_change=("auto/wd/report.html", "auto/tuned/", "auto/wd/savings.yaml", "auto/wd/rounds/"),
             check=_keeps_every_event_but_finish,
             note="valid: a complete last event without a final newline is still an event"),
        Case("journal-empty-in-finished-workdir-auto", RESUME, 2, ("journal.jsonl",),
             _mutate_text(JOURNAL, lambda d: b""), cwd="auto"),
        Case("journal-binary-auto", RESUME, 2, ("journal.jsonl",), _mutate_text(JOURNAL, lambda d: BINARY), cwd="auto"),
        Case("journal-binary-report", ["report", "wd", "--out", "new-report.html"], 2, ("journal.jsonl",),
             _mutate_text(JOURNAL, lambda d: BINARY), cwd="auto"),
        Case("journal-binary-reward-check", ["reward-check", "tuned/campaign-auto.yaml", "--against", "job.yaml",
                                             "--steps", "4", "--journal", "wd/journal.jsonl", "--out", "new-rc"],
             2, ("journal.jsonl",), _mutate_text(JOURNAL, lambda d: BINARY), cwd="auto"),
        # A writer killed mid-line leaves a torn tail: provably torn, so repairable.
        Case("journal-torn-tail-auto-repairs", RESUME, 0, (),
             _mutate_text(JOURNAL, lambda d: d + b'{"event": "trial", "run_id": "x", "kno'), cwd="auto",
             append_only=(JOURNAL,), may_change=("auto/wd/report.html", "auto/tuned/", "auto/wd/savings.yaml"),
             check=_keeps_every_event, note="valid: a torn last line is what a kill -9 leaves; it is cut, nothing else"),
        Case("journal-corrupt-middle-line-auto", RESUME, 2, ("journal.jsonl", "line 2"), _corrupt_middle, cwd="auto"),
        Case("journal-corrupt-middle-line-report", ["report", "wd", "--out", "new-report.html"], 2,
             ("journal.jsonl", "line 2"), _corrupt_middle, cwd="auto"),
        Case("journal-of-another-job-auto", RESUME, 2, ("journal.jsonl",), _another_jobs_journal, cwd="auto"),
        Case("journal-fed-another-job-auto", ["auto", "../fast/other.yaml", "--workdir", "wd", *AUTO], 2,
             ("journal.jsonl",), None, cwd="auto"),
        Case("journal-is-a-directory-auto", RESUME, 2, ("journal.jsonl",),
             lambda a: ((a / JOURNAL).unlink(), (a / JOURNAL).mkdir()), cwd="auto"),
    ]


# ---------------------------------------------------------------------------------------------------
# 4. Flags.

TRIAL = ["trial", "runs/base/forecast.yaml", "--job", "job.yaml", "--candidate", CAND, "--library", "cases"]
HUGE = "99999999999999999999999"


def _flag_cases() -> list[Case]:
    cases = []
    for value in ("0", "-1", HUGE):
        cases += [
            Case(f"profile-steps-{value[:6]}", ["profile", "job.yaml", "--steps", value, "--out", "new-run"], 2,
                 ("--steps",), cwd="fast"),
            Case(f"trial-steps-{value[:6]}", [*TRIAL, "--steps", value], 2, ("--steps",), cwd="fast"),
            Case(f"auto-steps-{value[:6]}", ["auto", "job.yaml", "--workdir", "new-wd", "--steps", value,
                                             "--tuned-dir", "tuned", "--no-live"], 2, ("--steps",), cwd="fast"),
            Case(f"reward-check-steps-{value[:6]}", ["reward-check", "learn.yaml", "--against", "learn.yaml",
                                                     "--steps", value, "--out", "new-rc"], 2, ("--steps",), cwd="fast"),
            Case(f"sync-bench-steps-{value[:6]}", ["sync-bench", "--preset", "cpu", "--steps", value, "--out", "sb"],
                 2, ("--steps",), cwd="fast"),
        ]
    cases += [
        Case("trial-steps-equal-to-warmup", [*TRIAL, "--steps", "1"], 2, ("--steps",), cwd="fast"),
        Case("auto-rounds-0", ["auto", "job.yaml", "--workdir", "new-wd", "--rounds", "0", "--no-live"], 2,
             ("--rounds",), cwd="fast"),
        Case("auto-parallel-0", ["auto", "job.yaml", "--workdir", "new-wd", "--parallel", "0", "--no-live"], 2,
             ("--parallel",), cwd="fast"),
        Case("reward-check-seeds-1", ["reward-check", "learn.yaml", "--against", "learn.yaml", "--steps", "4",
                                      "--seeds", "1", "--out", "new-rc"], 2, ("--seeds",), cwd="fast"),
        Case("reward-check-window-0", ["reward-check", "learn.yaml", "--against", "learn.yaml", "--steps", "4",
                                       "--window", "0", "--out", "new-rc"], 2, ("--window",), cwd="fast"),
        Case("profile-steps-with-from-logs", ["profile", "--from-logs", "metrics-ok.jsonl", "--steps", "3", "--out",
                                              "fl"], 2, ("--steps",), cwd="inputs"),
        Case("profile-warmup-without-from-logs", ["profile", "job.yaml", "--warmup", "2", "--out", "new-run"], 2,
             ("--warmup",), cwd="fast"),
        Case("profile-run-id-without-from-logs", ["profile", "job.yaml", "--run-id", "x", "--out", "new-run"], 2,
             ("--run-id",), cwd="fast"),
        Case("profile-library-with-from-logs", ["profile", "--from-logs", "metrics-ok.jsonl", "--library", "cases",
                                                "--out", "fl"], 2, ("--library",), cwd="inputs"),
        Case("profile-format-unknown", ["profile", "--from-logs", "metrics-ok.jsonl", "--format", "csv", "--out", "fl"],
             2, ("--format",), cwd="inputs"),
        Case("profile-rl-mode-unknown", ["profile", "--from-logs", "metrics-ok.jsonl", "--rl-mode", "warp", "--out",
                                         "fl"], 2, ("--rl-mode",), cwd="inputs"),
        Case("profile-warmup-negative", ["profile", "--from-logs", "metrics-ok.jsonl", "--warmup", "-1", "--out", "fl"],
             2, ("--warmup",), cwd="inputs"),
        Case("profile-vllm-metrics-not-url", ["profile", "job.yaml", "--vllm-metrics", "localhost:8000", "--out", "r"],
             2, ("--vllm-metrics",), cwd="fast"),
        Case("profile-job-and-from-logs", ["profile", "job.yaml", "--from-logs", "../inputs/metrics-ok.jsonl"], 2,
             ("--from-logs",), cwd="fast"),
        Case("profile-set-twice", ["profile", "job.yaml", "--set", "micro_batch_size=8", "--set",
                                   "micro_batch_size=16", "--out", "new-run"], 2, ("--set", "micro_batch_size"),
             cwd="fast"),
        Case("profile-set-not-a-number", ["profile", "job.yaml", "--set", "micro_batch_size=abc", "--out", "new-run"],
             2, ("--set", "micro_batch_size"), cwd="fast"),
        Case("profile-set-negative", ["profile", "job.yaml", "--set", "micro_batch_size=-8", "--out", "new-run"],
             2, ("--set", "micro_batch_size"), cwd="fast"),
        Case("profile-set-unknown-knob", ["profile", "job.yaml", "--set", "no_such_knob=1", "--out", "new-run"],
             2, ("--set", "no_such_knob"), cwd="fast"),
        Case("profile-set-no-equals", ["profile", "job.yaml", "--set", "micro_batch_size", "--out", "new-run"],
             2, ("--set",), cwd="fast"),
        Case("profile-set-unknown-rl-mode", ["profile", "job.yaml", "--set", "rl_mode=warp", "--out", "new-run"],
             2, ("--set", "rl_mode"), cwd="fast"),
        Case("propose-max-negative", ["propose", "runs/base/diagnosis.yaml", "--job", "job.yaml", "--max", "-3",
                                      "--out", "c.yaml"], 2, ("--max",), cwd="fast"),
        Case("propose-max-zero", ["propose", "runs/base/diagnosis.yaml", "--job", "job.yaml", "--max", "0",
                                  "--out", "c.yaml"], 2, ("--max",), cwd="fast"),
        Case("trial-candidate-unknown", ["trial", "runs/base/forecast.yaml", "--job", "job.yaml", "--candidate",
                                         "no-such-candidate", "--steps", "3", "--library", "cases"], 2,
             ("forecast.yaml", "no-such-candidate"), cwd="fast"),
        Case("predict-library-missing", ["predict", "runs/base/candidates.yaml", "--library", "no-such-cases",
                                         "--out", "f.yaml"], 2, ("--library", "no-such-cases"), cwd="real"),
        Case("eval-library-missing", ["eval", "--library", "no-such-cases"], 2, ("no-such-cases",), cwd="real"),
        Case("sync-bench-device-tpu", ["sync-bench", "--preset", "cpu", "--steps", "1", "--device", "tpu", "--out",
                                       "sb"], 2, ("--device", "tpu"), cwd="fast"),
        Case("sync-bench-readers-empty-item", ["sync-bench", "--readers", "1,,2", "--preset", "ci", "--steps", "1",
                                               "--out", "sb"], 2, ("--readers",), cwd="fast"),
        Case("sync-bench-readers-negative", ["sync-bench", "--readers", "-1", "--preset", "ci", "--steps", "1",
                                             "--out", "sb"], 2, ("--readers",), cwd="fast"),
        Case("sync-bench-readers-not-numbers", ["sync-bench", "--readers", "a,b", "--preset", "ci"], 2, ("--readers",),
             cwd="fast"),
        Case("sync-bench-storage-unknown", ["sync-bench", "--readers", "1", "--storage", "tape", "--preset", "ci"], 2,
             ("--storage",), cwd="fast"),
        Case("sync-bench-transports-unknown", ["sync-bench", "--preset", "cpu", "--steps", "1", "--transports",
                                               "pigeon", "--out", "sb"], 2, ("pigeon",), cwd="fast"),
        Case("sync-bench-preset-unknown", ["sync-bench", "--preset", "no-such-preset", "--out", "sb"], 2,
             ("no-such-preset",), cwd="fast"),
        Case("sync-bench-estimate-with-readers", ["sync-bench", "--estimate", "estimate.yaml", "--readers", "1,2"],
             2, ("--readers",), cwd="inputs"),
        Case("workload-run-steps-zero", ["workload", "run", "workload.yaml", "--steps", "0", "--run-dir", "wr"], 2,
             ("--steps",), cwd="inputs"),
        Case("workload-run-steps-negative", ["workload", "run", "workload.yaml", "--steps", "-1", "--run-dir", "wr"],
             2, ("--steps",), cwd="inputs"),
        Case("workload-check-override-unknown-key", ["workload", "check", "workload.yaml", "trainer.no_such_key=1"], 2,
             ("no_such_key",), cwd="inputs"),
        Case("workload-check-override-bad-value", ["workload", "check", "workload.yaml", "trainer.micro_batch_size=abc"],
             2, ("micro_batch_size",), cwd="inputs"),
        Case("workload-check-override-no-equals", ["workload", "check", "workload.yaml", "trainer.micro_batch_size"],
             2, ("micro_batch_size",), cwd="inputs"),
    ]
    return cases


# Missing files, and directories where files go (and files where directories go).

def _path_cases() -> list[Case]:
    mk_file = lambda rel: lambda area: (area / rel).write_text("I am a file\n")  # noqa: E731
    mk_dir = lambda rel: lambda area: (area / rel).mkdir(parents=True)  # noqa: E731
    cases = [
        Case("profile-job-missing", ["profile", "no-such.yaml", "--out", "new-run"], 2, ("no-such.yaml",), cwd="fast"),
        Case("profile-job-is-a-directory", ["profile", "runs", "--out", "new-run"], 2, ("runs",), cwd="fast"),
        Case("profile-from-logs-missing", ["profile", "--from-logs", "no-such.log", "--out", "fl"], 2,
             ("no-such.log",), cwd="inputs"),
        Case("propose-diagnosis-missing", ["propose", "no-such.yaml", "--job", "job.yaml"], 2, ("no-such.yaml",),
             cwd="fast"),
        Case("propose-diagnosis-is-a-directory", ["propose", "runs/base", "--job", "job.yaml", "--out", "c.yaml"], 2,
             ("runs/base",), cwd="fast"),
        Case("propose-job-missing", ["propose", "runs/base/diagnosis.yaml", "--job", "no-such.yaml", "--out", "c.yaml"],
             2, ("no-such.yaml",), cwd="fast"),
        Case("propose-knowledge-missing", ["propose", "runs/base/diagnosis.yaml", "--job", "job.yaml", "--knowledge",
                                           "no-such.yaml", "--out", "c.yaml"], 2, ("no-such.yaml",), cwd="fast"),
        Case("propose-untuned-missing", ["propose", "runs/base/diagnosis.yaml", "--job", "job.yaml", "--untuned",
                                         "no-such-run", "--out", "c.yaml"], 2, ("no-such-run",), cwd="fast"),
        Case("predict-candidates-missing", ["predict", "no-such.yaml", "--library", "cases"], 2, ("no-such.yaml",),
             cwd="real"),
        Case("predict-candidates-is-a-directory", ["predict", "runs", "--library", "cases"], 2, ("runs",), cwd="real"),
        Case("predict-library-is-a-file", ["predict", "runs/base/candidates.yaml", "--library", "lib-file",
                                           "--out", "f.yaml"], 2, ("lib-file",), mk_file("real/lib-file"), cwd="real"),
        Case("trial-forecast-missing", ["trial", "no-such.yaml", "--job", "job.yaml", "--steps", "3"], 2,
             ("no-such.yaml",), cwd="fast"),
        Case("trial-job-missing", ["trial", "runs/base/forecast.yaml", "--job", "no-such.yaml", "--candidate", CAND,
                                   "--steps", "3", "--library", "cases"], 2, ("no-such.yaml",), cwd="fast"),
        Case("trial-runs-root-is-a-file", [*TRIAL, "--steps", "3", "--runs-root", "rr-file"], 2, ("rr-file",),
             mk_file("fast/rr-file"), cwd="fast"),
        Case("trial-library-is-a-file", ["trial", "runs/base/forecast.yaml", "--job", "job.yaml", "--candidate", CAND,
                                         "--steps", "3", "--library", "lib-file"], 2, ("lib-file",),
             mk_file("fast/lib-file"), cwd="fast"),
        Case("auto-job-missing", ["auto", "no-such.yaml", "--workdir", "new-wd", *AUTO], 2, ("no-such.yaml",),
             cwd="fast"),
        Case("auto-job-is-a-directory", ["auto", "runs", "--workdir", "new-wd", *AUTO], 2, ("runs",), cwd="fast"),
        Case("auto-workdir-is-a-file", ["auto", "job.yaml", "--workdir", "wd-file", *AUTO], 2, ("wd-file",),
             mk_file("fast/wd-file"), cwd="fast"),
        Case("auto-library-is-a-file", ["auto", "job.yaml", "--workdir", "new-wd", "--library", "lib-file", *AUTO], 2,
             ("lib-file",), mk_file("fast/lib-file"), cwd="fast"),
        Case("auto-tuned-dir-is-a-file", ["auto", "job.yaml", "--workdir", "new-wd", *AUTO[:-3], "--tuned-dir",
                                          "tuned-file", "--no-live"], 2, ("tuned-file",), mk_file("fast/tuned-file"),
             cwd="fast"),
        Case("auto-knowledge-missing", ["auto", "job.yaml", "--workdir", "new-wd", "--knowledge", "no-such.yaml", *AUTO],
             2, ("no-such.yaml",), cwd="fast"),
        Case("profile-out-is-a-file", ["profile", "job.yaml", "--steps", "3", "--out", "out-file"], 2, ("out-file",),
             mk_file("fast/out-file"), cwd="fast"),
        Case("profile-library-is-a-file", ["profile", "job.yaml", "--steps", "3", "--out", "new-run", "--library",
                                           "lib-file"], 2, ("lib-file",), mk_file("fast/lib-file"), cwd="fast"),
        Case("report-workdir-missing", ["report", "no-such-wd"], 2, ("no-such-wd",), cwd="auto"),
        Case("report-workdir-is-a-file", ["report", "job.yaml"], 2, ("job.yaml",), cwd="auto"),
        Case("report-out-is-a-directory", ["report", "wd", "--out", "out-dir"], 2, ("out-dir",),
             mk_dir("auto/out-dir"), cwd="auto"),
        Case("eval-library-is-a-file", ["eval", "--library", "lib-file"], 2, ("lib-file",), mk_file("real/lib-file"),
             cwd="real"),
        Case("eval-out-is-a-file", ["eval", "--library", "cases", "--out", "out-file"], 2, ("out-file",),
             mk_file("real/out-file"), cwd="real"),
        Case("propose-out-is-a-directory", ["propose", "runs/base/diagnosis.yaml", "--job", "job.yaml", "--out",
                                            "out-dir"], 2, ("out-dir",), mk_dir("fast/out-dir"), cwd="fast"),
        Case("predict-out-is-a-directory", ["predict", "runs/base/candidates.yaml", "--library", "cases", "--out",
                                            "out-dir"], 2, ("out-dir",), mk_dir("real/out-dir"), cwd="real"),
        Case("reward-check-out-is-a-file", ["reward-check", "learn.yaml", "--against", "learn.yaml", "--steps", "4",
                                            "--out", "out-file"], 2, ("out-file",), mk_file("fast/out-file"), cwd="fast"),
        Case("reward-check-tuned-missing", ["reward-check", "no-such.yaml", "--against", "learn.yaml", "--steps", "4",
                                            "--out", "new-rc"], 2, ("no-such.yaml",), cwd="fast"),
        Case("reward-check-journal-missing", ["reward-check", "learn.yaml", "--against", "learn.yaml", "--steps", "4",
                                              "--journal", "no-such.jsonl", "--out", "new-rc"], 2, ("no-such.jsonl",),
             cwd="fast"),
        Case("reward-check-journal-is-a-directory", ["reward-check", "learn.yaml", "--against", "learn.yaml", "--steps",
                                                     "4", "--journal", "runs", "--out", "new-rc"], 2, ("runs",),
             cwd="fast"),
        Case("sync-bench-out-is-a-file", ["sync-bench", "--preset", "cpu", "--steps", "1", "--transports", "inprocess",
                                          "--out", "out-file"], 2, ("out-file",), mk_file("fast/out-file"), cwd="fast"),
        Case("sync-bench-estimate-missing", ["sync-bench", "--estimate", "no-such.yaml"], 2, ("no-such.yaml",),
             cwd="inputs"),
        Case("sync-bench-estimate-is-a-directory", ["sync-bench", "--estimate", "."], 2, (".",), cwd="inputs"),
        Case("sync-bench-preset-file-binary", ["sync-bench", "--preset", "sync-preset.yaml", "--steps", "1", "--out",
                                               "sb"], 2, ("sync-preset.yaml",),
             _mutate_text("inputs/sync-preset.yaml", lambda d: BINARY), cwd="inputs"),
        Case("sync-bench-preset-file-malformed", ["sync-bench", "--preset", "sync-preset.yaml", "--steps", "1", "--out",
                                                  "sb"], 2, ("sync-preset.yaml",),
             _mutate_text("inputs/sync-preset.yaml", lambda d: d + b"\nx: [1,\n"), cwd="inputs"),
        Case("sync-bench-preset-file-unknown-key", ["sync-bench", "--preset", "sync-preset.yaml", "--steps", "1",
                                                    "--out", "sb"], 2, ("sync-preset.yaml", "no_such_key"),
             _mutate_text("inputs/sync-preset.yaml", lambda d: d + b"\nno_such_key: 1\n"), cwd="inputs"),
        Case("workload-check-missing", ["workload", "check", "no-such.yaml"], 2, ("no-such.yaml",), cwd="inputs"),
        Case("workload-check-is-a-directory", ["workload", "check", "."], 2, (".",), cwd="inputs"),
        Case("workload-run-run-dir-is-a-file", ["workload", "run", "workload.yaml", "--steps", "1", "--run-dir",
                                                "out-file"], 2, ("out-file",), mk_file("inputs/out-file"), cwd="inputs"),
    ]
    return cases


# Outputs equal to inputs, or another run's directory.

def _overwrite_cases() -> list[Case]:
    return [
        Case("propose-out-is-its-diagnosis", ["propose", "runs/base/diagnosis.yaml", "--job", "job.yaml", "--out",
                                              "runs/base/diagnosis.yaml"], 2, ("diagnosis.yaml",), cwd="fast"),
        Case("propose-out-is-its-job", ["propose", "runs/base/diagnosis.yaml", "--job", "job.yaml", "--out",
                                        "job.yaml"], 2, ("job.yaml",), cwd="fast"),
        Case("predict-out-is-its-candidates", ["predict", "runs/base/candidates.yaml", "--library", "cases", "--out",
                                               "runs/base/candidates.yaml"], 2, ("candidates.yaml",), cwd="real"),
        Case("predict-out-inside-library", ["predict", "runs/base/candidates.yaml", "--library", "cases", "--out",
                                            "cases/forecast.yaml"], (0, 2), (),
             cwd="real", note="a YAML beside the case parts is not a case; refusing it is also fine"),
        Case("report-out-is-the-journal", ["report", "wd", "--out", "wd/journal.jsonl"], 2, ("journal.jsonl",),
             cwd="auto"),
        Case("report-out-is-a-verdict", ["report", "wd", "--out", "wd/{trial_dir}/verdict.yaml"], 2,
             ("verdict.yaml",), cwd="auto"),
        Case("profile-from-logs-out-another-runs-dir", ["profile", "--from-logs", "../inputs/metrics-ok.jsonl",
                                                        "--format", "rltune", "--out", "runs/base"], 2, ("runs/base",),
             cwd="fast"),
        Case("profile-out-another-runs-dir", ["profile", "job.yaml", "--steps", "3", "--out", "runs/base"], 2,
             ("runs/base",), cwd="fast"),
        Case("profile-out-a-trial-run-of-auto", ["profile", "job.yaml", "--steps", "3", "--out", "wd/{trial_dir}"], 2,
             ("wd/",), cwd="auto"),
        Case("profile-out-is-the-job", ["profile", "job.yaml", "--steps", "3", "--out", "job.yaml"], 2, ("job.yaml",),
             cwd="fast"),
        Case("eval-out-is-the-library", ["eval", "--library", "cases", "--out", "cases"], 2, ("cases",), cwd="real"),
        Case("reward-check-out-is-auto-workdir", ["reward-check", "tuned/campaign-auto.yaml", "--against", "job.yaml",
                                                  "--steps", "4", "--out", "wd"], 2, ("wd",), cwd="auto"),
        Case("auto-workdir-is-a-run-dir", ["auto", "job.yaml", "--workdir", "runs/base", *AUTO], 2, ("runs/base",),
             cwd="fast"),
        Case("auto-library-is-a-run-dir", ["auto", "job.yaml", "--workdir", "new-wd", "--library", "runs/base", *AUTO],
             2, ("runs/base",), cwd="fast"),
        Case("workload-run-run-dir-another-run", ["workload", "run", "../inputs/workload.yaml", "--steps", "1",
                                                  "--run-dir", "runs/base"], 2, ("runs/base",), cwd="fast"),
    ]


# ---------------------------------------------------------------------------------------------------
# 5. Names taken from files: a job named '../../../../tmp/x' writes nothing outside its directories.

ESCAPE = "../../../../tmp/x"


def _escape_cases() -> list[Case]:
    name_it = _chain(_job_input, _mutate_data(JOB_IN, "name", ESCAPE))
    return [
        Case("job-name-escapes-auto", ["auto", "inputs/job.yaml", "--workdir", "new-wd", *AUTO], (0, 2), (), name_it,
             note="exit 0 is fine if the name is sanitised; what must hold is that nothing lands outside"),
        Case("job-name-escapes-profile-default-out", ["profile", "inputs/job.yaml", "--steps", "3"], (0, 2), (),
             name_it, note="exit 0 is fine if the name is sanitised; what must hold is that nothing lands outside"),
        Case("job-name-escapes-trial", ["trial", "runs/base/forecast.yaml", "--job", "../inputs/job.yaml",
                                        "--candidate", CAND, "--steps", "3", "--library", "cases", "--no-remeasure"],
             (0, 2, 3), (), name_it, cwd="fast",
             note="another job's name: refusing is right (item 3), but what must hold is nothing outside"),
        Case("job-name-with-slash-auto", ["auto", "inputs/job.yaml", "--workdir", "new-wd", *AUTO], (0, 2), (),
             _chain(_job_input, _mutate_data(JOB_IN, "name", "a/b/../../../c")),
             note="exit 0 is fine if the name is sanitised; what must hold is that nothing lands outside"),
    ]


# ---------------------------------------------------------------------------------------------------
# 6. Trials with input errors record nothing; jobs that crash, hang or measure garbage exit 4.

def _failing_job_cases() -> list[Case]:
    cases = [
        Case("trial-command-not-on-path", ["trial", "runs/base/forecast.yaml", "--job", "job-missing-program.yaml",
                                           "--candidate", CAND, "--steps", "3", "--library", "cases"], 2,
             ("job-missing-program.yaml", "command"), cwd="fast"),
        Case("profile-command-not-on-path", ["profile", "job-missing-program.yaml", "--steps", "3", "--out", "new-run"],
             2, ("job-missing-program.yaml", "command"), cwd="fast"),
        Case("auto-command-not-on-path", ["auto", "job-missing-program.yaml", "--workdir", "new-wd", *AUTO], 2,
             ("job-missing-program.yaml", "command"), cwd="fast"),
    ]
    # A launched job that measured nothing rltune can use failed (4), and says which file and step.
    for mode, exits, names in [("crash", 4, ("code 1",)), ("hang", 4, ("time",)), ("empty", 4, ("metrics.jsonl",)),
                               ("nan", 4, ("metrics.jsonl", "step_s")), ("negative", 4, ("metrics.jsonl", "step_s")),
                               ("inf", 4, ("metrics.jsonl", "step_s")), ("huge", 4, ("metrics.jsonl", "step_s")),
                               ("garbage", 4, ("metrics.jsonl",))]:
        job = f"job-{mode}.yaml"
        cases += [
            Case(f"profile-job-{mode}", ["profile", job, "--steps", "3", "--out", "new-run", "--library", "cases"],
                 exits, names if exits == 4 else (job,), cwd="fast"),
            Case(f"trial-job-{mode}", ["trial", "runs/base/forecast.yaml", "--job", job, "--candidate", CAND,
                                       "--steps", "3", "--library", "cases", "--no-remeasure"], exits,
                 names if exits == 4 else (job,), cwd="fast"),
        ]
    cases.append(Case("auto-baseline-crashes", ["auto", "job-crash.yaml", "--workdir", "new-wd", *AUTO], 4, (),
                      cwd="fast"))
    for mode in ("nan", "negative", "inf", "huge", "garbage"):
        metrics = f"metrics-{mode}.jsonl"
        cases.append(Case(f"from-logs-{mode}-times", ["profile", "--from-logs", metrics, "--format", "rltune", "--out",
                                                      "fl"], 2, (metrics,), cwd="inputs"))
    return cases


# ---------------------------------------------------------------------------------------------------
# 7. One job's artifacts fed to another job's command.

def _cross_job_cases() -> list[Case]:
    return [
        Case("propose-diagnosis-of-another-job", ["propose", "runs/base/diagnosis.yaml", "--job", "other.yaml", "--out",
                                                  "c.yaml"], 2, ("other.yaml",), cwd="fast"),
        Case("predict-candidates-of-another-job", ["predict", "runs/base/candidates.yaml", "--job", "other.yaml",
                                                   "--library", "cases", "--out", "f.yaml"], 2, ("other.yaml",),
             cwd="fast"),
        Case("trial-forecast-of-another-job", ["trial", "runs/base/forecast.yaml", "--job", "other.yaml", "--candidate",
                                               CAND, "--steps", "3", "--library", "cases"], 2, ("other.yaml",),
             cwd="fast"),
        Case("reward-check-tuned-of-another-job", ["reward-check", "tuned/campaign-auto.yaml", "--against",
                                                   "../fast/other.yaml", "--steps", "4", "--out", "new-rc"], 2,
             ("other.yaml",), cwd="auto"),
        Case("predict-library-of-another-job", ["predict", "runs/base/candidates.yaml", "--library", "../real/cases",
                                                "--out", "f.yaml"], (0,), (), cwd="fast",
             note="valid: a library holds many jobs; predict records this job's baseline in it and weighs by "
                  "similarity"),
        Case("trial-library-of-another-job", ["trial", "runs/base/forecast.yaml", "--job", "job.yaml", "--candidate",
                                              CAND, "--steps", "3", "--library", "../real/cases", "--no-remeasure"],
             (0, 3), (), cwd="fast", may_change=(),
             note="valid: a shared library; the trial appends its own case and keeps every other"),
    ]


ALL_CASES = [_fix_yaml_case(c) for c in
             [*_yaml_cases(), *_more_job_cases(), *_parquet_cases(), *_journal_cases(), *_flag_cases(),
              *_path_cases(), *_overwrite_cases(), *_escape_cases(), *_failing_job_cases(), *_cross_job_cases()]]
IDS = [c.id for c in ALL_CASES]
assert len(IDS) == len(set(IDS)), sorted({i for i in IDS if IDS.count(i) > 1})


def _in_subprocess(argv: list[str]) -> bool:
    """Commands that would run for minutes if they wrongly accepted: killed whole past a time-out."""
    return (argv[0] in ("sync-bench", "reward-check") and "--estimate" not in argv) or argv[:2] == ["workload", "run"]


def _fill(text: str, info: dict) -> str:
    return text.replace(CAND, info["candidate"] or "").replace("{trial_dir}", info["trial_dir"] or "missing")


@pytest.mark.timeout(180)
@pytest.mark.parametrize("case", ALL_CASES, ids=IDS)
def test_bad_input(case: Case, area: Path, area_info: dict, capsys, monkeypatch):
    _INFO.update(area_info)
    case = dataclasses.replace(case, argv=[_fill(a, area_info) for a in case.argv],
                               may_change=tuple(_fill(p, area_info) for p in case.may_change))
    if case.prepare is not None:
        case.prepare(area)
    root = area.parents[4]
    before = snapshot(area)
    contents = {p: (area / p).read_bytes() for p in case.append_only}
    outside = files_outside(root, area)
    cwd = area / case.cwd
    monkeypatch.chdir(cwd)
    monkeypatch.setenv("COLUMNS", "200")
    if _in_subprocess(case.argv):
        outcome = run_subprocess(case.argv, cwd, SUBPROCESS_TIMEOUT_S)
    else:
        outcome = run_in_process(case.argv, capsys)
    # Every check runs, so a case that both answers wrongly and loses data says both.
    problems = []
    for check in (lambda: assert_outcome(case, outcome),
                  lambda: assert_records_intact(before, area, contents, case.may_change, case.append_only),
                  lambda: _refusal_recorded_nothing(outcome, before, area),
                  lambda: _nothing_outside(root, area, outside),
                  lambda: case.check(area) if case.check is not None else None):
        try:
            check()
        except AssertionError as exc:
            problems.append(str(exc).split("\nassert ")[0])
    assert not problems, "\n".join(problems)


def _refusal_recorded_nothing(outcome, before: dict, area: Path) -> None:
    if outcome.rc == 2:
        recorded = new_records(before, area)
        assert not recorded, f"a refused command recorded {recorded}"


def _nothing_outside(root: Path, area: Path, outside: set) -> None:
    escaped = files_outside(root, area) - outside
    assert not escaped, f"written outside the work area: {sorted(escaped)}"


def test_the_campaign_is_broad():
    """Issue 41 asks for several hundred bad inputs through every command."""
    commands = {c.argv[0] for c in ALL_CASES}
    assert commands >= {"profile", "propose", "predict", "trial", "auto", "report", "eval", "reward-check",
                        "sync-bench", "workload"}
    assert len(ALL_CASES) >= 200, len(ALL_CASES)
    # a refusal is checked for naming at least its file or flag
    unnamed = [c.id for c in ALL_CASES if c.exit == 2 and not c.names]
    assert not unnamed, unnamed


def test_the_shared_area_is_as_the_setup_left_it(area_info):
    """Every case ran on a copy: the session's own chain and work dir were never touched."""
    assert snapshot(area_info["root"]) == area_info["snapshot"]
