"""Public measured runs as cases: the rows of a public-runs CSV, read into the case library.

``rltune library import FILE.csv --library DIR`` (:func:`import_public_runs`) turns each row of the
layout :mod:`rltune.contracts.public_runs` defines into a :class:`~rltune.contracts.cases.CaseRecord`
with ``origin: public``:

- the setup from its columns and the settings of ``other_settings`` this module knows (the GPU type,
  the trainer/engine split and whether they share GPUs, tensor/pipeline/data/expert/context parallel
  degrees, engine tensor parallelism, precision, sequence lengths, LoRA, activation checkpointing,
  ...: :func:`case_from_row`); what a row does not give stays absent -- never a default;
- the times it publishes (``step_s``, ``rollout_s``, ``training_s``, ``weight_sync_s``) and its
  throughput, under a name that says its unit (``tokens_per_s_per_gpu`` where the notes say per GPU,
  ``tokens_per_s_all_gpus`` where they say for all GPUs, ``published_tokens_per_s`` otherwise);
- its provenance: the file and row, the source, the commit and release it was published at, and the
  row's own settings and notes as published.

A row with no time and no throughput is a failed run (``status: failed``); a row whose numbers
contradict each other (two step times that disagree, a stage longer than the step, a GPU split
that adds up to more GPUs than the job has, parallel degrees that do not multiply to the trainer's
GPUs) is imported as measured and left out of fits and forecasts (``excluded``, with the reason).
A measurement published twice (the same cells but for ``notes``, e.g. the same baseline at two
commits) is one case: its run id is a hash of those cells.

The import validates every row before it writes anything: a malformed row is one located error
(:func:`rltune.contracts.public_runs.read_public_runs`), and a run id the library already holds with
other content refuses the whole import, so a refused import leaves the library as it was.

:func:`shipped_cases` reads the public runs that install with rltune (``rltune/predict/public/``, with
their provenance README) into memory: the prior library that stands behind forecasts of GPU jobs
the user's own library has no runs of yet (:mod:`rltune.predict.forecast`).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rltune.contracts.cases import CaseRecord, record_to_row
from rltune.contracts.public_runs import PublicRun, read_public_runs
from rltune.errors import MalformedFileError
from rltune.predict.library import DuplicateCaseError

if TYPE_CHECKING:
    from rltune.predict.library import CaseLibrary

SHIPPED_DIR = Path(__file__).resolve().parent / "public"
SHIPPED_FILES = ("nemo_rl.csv", "prime_rl.csv", "prime_rl_history.csv", "easyr1.csv", "torchtitan.csv")
TRAINER_ONLY = "trainer_only"  # the workload of a trainer benchmark: no rollout, no weight sync
# Two step times of one row (published and from its throughput) further apart than this contradict each other.
STEP_AGREEMENT = 1.15
STAGE_SLACK = 1.05  # a published stage may exceed the published step by rounding, not more

# GPU type as sources write it -> the device name the theory's datasheet knows; first match wins.
DEVICE_PATTERNS: list[tuple[str, str]] = [
    (r"GB300", "GB300"), (r"GB200", "GB200"), (r"B300", "B300"), (r"B200", "B200"), (r"H200", "H200"), (r"H800", "H800"),
    (r"H100.*HBM2e", "H100-HBM2e"), (r"H100", "H100"), (r"\bH20\b", "H20"), (r"A100", "A100"), (r"A800", "A800"),
    (r"L40S", "L40S"), (r"\bL20\b", "L20"), (r"A6000", "A6000"), (r"MI300X", "MI300X"), (r"MI355X", "MI355X"),
]


def device_name(gpu: str) -> str:
    """'H100-80GB (DGX-H100)' -> 'H100', 'NVIDIA RTX A6000' -> 'A6000'; an unknown type keeps its own words."""
    for pattern, name in DEVICE_PATTERNS:
        if re.search(pattern, gpu, flags=re.I):
            return name
    return re.sub(r"\s+", "-", re.sub(r"\(.*?\)", "", gpu).strip()) or gpu


def source_slug(source: str) -> str:
    """'NeMo-RL performance-summary' -> 'nemo-rl': the source's first word, for run ids and job names."""
    word = source.strip().split()[0] if source.strip() else "public"
    return re.sub(r"[^a-z0-9]+", "-", word.lower()).strip("-") or "public"


@dataclass
class RowMode:
    rl_mode: str
    workload: str | None  # TRAINER_ONLY, or None (from the task)
    colocated: bool | None
    max_sample_age: int | None = None
    objective: str | None = None


def parse_rl_mode(run: PublicRun) -> RowMode:
    """The RL mode from the source's words; an unreadable one is a located error."""
    text = run.values["rl_mode"]
    low = text.lower()
    colocated = None
    if "non-colocated" in low or "non colocated" in low or "separate" in low:
        colocated = False
    elif "colocated" in low or "hybrid engine" in low:
        colocated = True
    if any(word in low for word in ("trainer-only", "trainer only", "pre-training", "pretraining")):
        objective = "pretrain" if "pre-training" in low or "pretraining" in low else None
        return RowMode("sync", TRAINER_ONLY, None, objective=objective)
    if low.startswith("sync") or low.startswith("on-policy") or low.startswith("synchronous"):
        return RowMode("sync", None, colocated)
    if "async" in low:
        steps = re.search(r"(\d+)[- ]step", low)
        age = int(steps.group(1)) if steps else (1 if "one-step" in low or "1-step" in low else None)
        if age is None:
            raise MalformedFileError(run.file, run.where("rl_mode"), f"cannot tell how many steps {text!r} runs ahead; "
                                                                     "write e.g. 'async 1-step off-policy'")
        if age == 1:
            return RowMode("one_step_async", None, colocated)
        return RowMode("fully_async", None, colocated, max_sample_age=age)
    raise MalformedFileError(run.file, run.where("rl_mode"), f"cannot tell the RL mode from {text!r}; write one of 'sync ...', "
                                                             "'async N-step ...', 'trainer-only ...', 'pre-training ...'")


def _int_prefix(text: str | None) -> int | None:
    m = re.match(r"\s*(\d+)", text or "")
    return int(m.group(1)) if m else None


def _float_prefix(text: str | None) -> float | None:
    m = re.match(r"\s*([0-9]*\.?[0-9]+(?:[eE][-+]?\d+)?)", text or "")
    return float(m.group(1)) if m else None


def _dtype(word: str) -> str | None:
    low = word.lower()
    for name in ("fp8", "bf16", "fp16", "fp32", "fp4"):
        if name in low.replace("float8", "fp8").replace("bfloat16", "bf16"):
            return name
    return "amp" if "amp" in low else None


def _release(run: PublicRun, settings: dict[str, str], commit: str | None) -> str | None:
    for key, value in settings.items():
        m = re.fullmatch(r"(?:[A-Za-z][\w .+-]*\s)?(v\d+(?:\.\d+)+)", key.strip()) if not value else None
        if m:
            return m.group(1)
    return commit


def _commit(notes: str | None) -> str | None:
    m = re.search(r"@\s?([0-9a-f]{7,40})\b", notes or "")
    return m.group(1) if m else None


def _timestamp(settings: dict[str, str]) -> float | None:
    text = settings.get("timestamp")
    if not text:
        return None
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def _throughput_name(notes: str) -> str:
    low = notes.lower()
    if "per gpu" in low or "tps/gpu" in low or "/gpu" in low:
        return "tokens_per_s_per_gpu"
    if "all gpus" in low:
        return "tokens_per_s_all_gpus"
    return "published_tokens_per_s"


@dataclass
class ImportedRow:
    """What one row became: its case, and where it came from."""

    run: PublicRun
    case: CaseRecord
    duplicate_of: int | None = None  # the row of the same file holding the same measurement


def case_from_row(run: PublicRun) -> CaseRecord:
    """One row -> a public case (see the module docstring); raises a located error for a row it cannot read."""
    v = run.values
    settings = run.settings()
    notes = v.get("notes") or ""
    mode = parse_rl_mode(run)
    device = device_name(v["gpu"])
    commit = _commit(notes)
    release = _release(run, settings, commit)
    facts: dict[str, Any] = {"total_params": float(v["params_b"]) * 1e9}
    knobs: dict[str, Any] = {}
    derived: list[str] = []
    if v.get("active_params_b") is not None:
        facts["active_params"] = float(v["active_params_b"]) * 1e9
        facts["moe"] = 1.0 if v["active_params_b"] < v["params_b"] * (1 - 1e-9) else 0.0
    if v.get("batch_prompts") is not None:
        facts["tasks_per_batch"] = float(v["batch_prompts"])
    if v.get("samples_per_prompt") is not None:
        facts["trials_per_task"] = float(v["samples_per_prompt"])
    samples = _int_prefix(settings.get("G-GBS(samples/step)"))
    if samples and ("tasks_per_batch" not in facts or "trials_per_task" not in facts):
        facts["samples_per_step"] = float(samples)
    if v.get("max_response_len") is not None:
        # NeMo-RL's column holds T-Max Sequence Length, the cap on prompt + response (its notes say so)
        total_cap = "prompt+response" in notes.replace(" ", "").lower()
        facts["context_limit_tokens" if total_cap else "answer_cap_tokens"] = float(v["max_response_len"])
    workload = mode.workload or _workload(settings)
    # sequence lengths
    mean_len = _int_prefix(settings.get("G-Average Seq len"))
    seq_len = _int_prefix(settings.get("seq_len"))
    if mean_len:
        facts["sequence_tokens"] = float(mean_len)
    elif seq_len:
        facts["sequence_tokens"] = float(seq_len)
    tokens = _int_prefix(settings.get("tokens_per_step"))
    if tokens:
        facts["tokens_per_step"] = float(tokens)
    elif workload == TRAINER_ONLY and seq_len:
        global_batch = _int_prefix(settings.get("global_batch_size"))
        local = _int_prefix(settings.get("local_batch_size")) or v.get("micro_batch")
        if global_batch:
            facts["tokens_per_step"] = float(global_batch * seq_len)
            derived.append("tokens_per_step = global_batch_size x seq_len")
        elif local and v.get("dp"):
            facts["tokens_per_step"] = float(local * v["dp"] * seq_len)
            derived.append("tokens_per_step = local_batch_size x dp x seq_len")
    # the GPU split and the layout
    if v.get("trainer_gpus") is not None:
        knobs["trainer_gpus"] = int(v["trainer_gpus"])
    if v.get("rollout_gpus") is not None and workload != TRAINER_ONLY:
        knobs["rollout_gpus"] = int(v["rollout_gpus"])
    if mode.colocated is not None:
        knobs["colocated"] = mode.colocated
    if mode.max_sample_age is not None:
        knobs["max_sample_age"] = mode.max_sample_age
    for column, knob in (("tp", "trainer_tp"), ("pp", "trainer_pp"), ("dp", "trainer_dp"), ("ep", "trainer_ep")):
        if v.get(column) is not None:
            knobs[knob] = int(v[column])
    layout = _nemo_layout(settings)
    cp = _int_prefix(settings.get("cp"))
    if cp is None and layout is not None:
        cp = layout["cp"]
    if cp is not None:
        knobs["trainer_cp"] = cp
    gen_tp = _int_prefix(settings.get("gen TP"))
    if gen_tp is None:
        m = re.search(r"\bTP\s*=\s*(\d+)", v.get("engine") or "")
        gen_tp = int(m.group(1)) if m and workload != TRAINER_ONLY else None
    if gen_tp is not None:
        knobs["engine_tp"] = gen_tp
    if v.get("micro_batch") is not None:
        knobs["micro_batch_size"] = int(v["micro_batch"])
    if settings.get("micro_batches"):
        knobs["micro_batches"] = _int_prefix(settings["micro_batches"])
    train_batch = _int_prefix(settings.get("T-GBS"))
    if train_batch:
        knobs["train_batch_samples"] = train_batch
    _precision(settings, v, knobs)
    _trainer_settings(settings, v, knobs, workload)
    if mode.objective or settings.get("type"):
        knobs["objective"] = mode.objective or settings["type"].strip().lower()
    if settings.get("algorithm"):
        knobs["algorithm"] = settings["algorithm"].strip().lower()
    knobs = {k: val for k, val in knobs.items() if val is not None}
    knobs["rl_mode"] = mode.rl_mode
    # what it measured
    measured: dict[str, float] = {}
    for column, name in (("step_s", "step_s"), ("rollout_s", "rollout_s"), ("train_s", "training_s"), ("sync_s", "weight_sync_s")):
        if v.get(column) is not None:
            measured[name] = float(v[column])
    if v.get("tokens_per_s") is not None:
        measured[_throughput_name(notes)] = float(v["tokens_per_s"])
    stamp = _timestamp(settings)
    std = _float_prefix(settings.get("step_time_std"))
    noise = std / measured["step_s"] if std is not None and measured.get("step_s") else None
    status, excluded = "ok", None
    if not measured:
        status = "failed"
        failure = re.search(r"(FAILED[^|]*)", notes)
        excluded = failure.group(1).strip() if failure else "the row publishes no time and no throughput: a failed run"
        excluded = excluded[:500]
    else:
        excluded = _contradiction(run, mode, measured, settings, knobs, layout)
    provenance = {"file": os.path.basename(run.file), "row": run.row, "line": run.line, "source": v["source"], "commit": commit,
                  "release": release, "gpu": v["gpu"], "rl_mode": v["rl_mode"], "engine": v.get("engine"),
                  "other_settings": v.get("other_settings"), "notes": notes or None}
    if derived:
        provenance["derived"] = derived
    slug = source_slug(v["source"])
    record = CaseRecord(
        run_id=f"public/{slug}/{_slug(v['model'])}/{v['gpus']}x{device}/{measurement_key(run)[:12]}",
        job=f"{slug}:{v['model']}", model=v["model"], workload=workload, rl_mode=mode.rl_mode, gpus=int(v["gpus"]),
        device=device, status=status, started_at=stamp or 0.0, finished_at=stamp or 0.0, warmup_steps=0, measured_steps=0,
        facts=facts, knobs=knobs, measured=measured, forecast=None, step_noise_frac=noise, source=v["source"],
        statistic="published", origin="public", release=release, provenance=provenance, excluded=excluded,
    )
    record.validate(f"{run.file}: {run.where()}")
    return record


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-") or "model"


def measurement_key(run: PublicRun) -> str:
    """A hash of every cell but ``notes``: equal for the same measurement published twice."""
    cells = {k: v for k, v in run.values.items() if k != "notes"}
    return hashlib.sha256(json.dumps(cells, sort_keys=True, default=str).encode()).hexdigest()


def _workload(settings: dict[str, str]) -> str:
    task = (settings.get("task") or "").lower()
    algorithm = (settings.get("algorithm") or "").lower()
    if "vision" in task:
        return "vision_language"
    if "swe" in algorithm or "swe" in task:
        return "swe"
    return "rl"  # an RL job whose task the source does not state


def _nemo_layout(settings: dict[str, str]) -> dict[str, int] | None:
    """NeMo-RL's 'train [TP,CP,EP,PP,VPP]=[2,2,16,8,n/a]' cell; None where it is absent or malformed (not 5 entries)."""
    text = settings.get("train [TP,CP,EP,PP,VPP]")
    if not text:
        return None
    parts = [p.strip() for p in text.strip("[] ").split(",")]
    if len(parts) != 5 or not all(p.isdigit() for p in parts[:4]):
        return None
    tp, cp, ep, pp = (int(p) for p in parts[:4])
    return {"tp": tp, "cp": cp, "ep": ep, "pp": pp}


def _precision(settings: dict[str, str], v: dict[str, Any], knobs: dict[str, Any]) -> None:
    text = settings.get("precision")
    if text:  # 'train BF16, gen BF16'
        for part in text.split(","):
            words = part.strip().split()
            if len(words) >= 2 and words[0].lower() == "train":
                knobs["train_dtype"] = _dtype(words[1])
            elif len(words) >= 2 and words[0].lower() in ("gen", "generation"):
                knobs["weight_dtype"] = _dtype(words[1])
    if settings.get("bits"):
        knobs["train_dtype"] = _dtype(settings["bits"])
    techniques = settings.get("techniques") or ""
    if techniques:
        knobs["train_dtype"] = "fp8" if "float8" in techniques.lower() else "bf16"


def _trainer_settings(settings: dict[str, str], v: dict[str, Any], knobs: dict[str, Any], workload: str) -> None:
    if "lora_rank" in settings:
        knobs["lora_rank"] = _int_prefix(settings["lora_rank"])
    elif "full fine-tune" in settings:
        knobs["lora_rank"] = 0
    ac = (settings.get("ac") or settings.get("activation_checkpointing") or "").lower()
    if ac:
        knobs["activation_checkpointing"] = {"recompute": "full", "full": "full", "selective": "selective",
                                             "offload": "offload"}.get(ac.split()[0])
    if settings.get("attention"):
        knobs["attention_kernel"] = settings["attention"].strip()
    techniques = (settings.get("techniques") or "").lower()
    engine = (v.get("engine") or "").lower()
    if "compile" in techniques or "torch.compile" in engine:
        knobs["compile"] = True
    elif techniques:
        knobs["compile"] = False
    if "asynctp" in techniques.replace(" ", ""):
        knobs["async_tp"] = True
    if "interleaved 1f1b" in techniques:
        knobs["pp_schedule"] = "interleaved_1f1b"
    elif "1f1b" in techniques:
        knobs["pp_schedule"] = "1f1b"
    if settings.get("local_batch_size") and "micro_batch_size" not in knobs:
        knobs["micro_batch_size"] = _int_prefix(settings["local_batch_size"])
    if settings.get("micro_batch_size_per_device_for_experience"):
        knobs["logprob_micro_batch_size"] = _int_prefix(settings["micro_batch_size_per_device_for_experience"])
    memory = _float_prefix(settings.get("vLLM gpu_memory_utilization"))
    if memory is not None:
        knobs["engine_memory_fraction"] = memory
    text = v.get("other_settings") or ""
    if "padding_free=true" in text:
        knobs["packing"] = True
    if "dynamic_batching=true" in text:
        knobs["dynamic_batching"] = True
    if "offload params+optimizer=true" in text:
        knobs["trainer_offload"] = True


def _contradiction(run: PublicRun, mode: RowMode, measured: dict[str, float], settings: dict[str, str], knobs: dict[str, Any],
                   layout: dict[str, int] | None) -> str | None:
    """The first way the row's numbers contradict each other, or None."""
    v = run.values
    step = measured.get("step_s")
    other = _float_prefix(settings.get("step_from_throughput_s"))
    if step and other:
        ratio = max(step, other) / min(step, other)
        if ratio > STEP_AGREEMENT:
            return (f"two step times disagree: step_s {step:g} s, and {other:g} s from tokens_per_step / tokens_per_s "
                    f"(x{ratio:.2f}, more than x{STEP_AGREEMENT:g})")
    stages = {name: measured[name] for name in ("rollout_s", "training_s", "weight_sync_s") if name in measured}
    if step:
        for name, value in stages.items():
            if value > step * STAGE_SLACK and not (mode.rl_mode == "fully_async" and name == "rollout_s"):
                return f"{name} {value:g} s exceeds the step's {step:g} s"
        if mode.rl_mode == "sync" and len(stages) > 1 and sum(stages.values()) > step * STAGE_SLACK:
            return f"the stages add up to {sum(stages.values()):g} s, more than the synchronous step's {step:g} s"
    trainer, rollout = v.get("trainer_gpus"), v.get("rollout_gpus")
    if mode.colocated is False and trainer and rollout and trainer + rollout > v["gpus"]:
        return f"trainer_gpus {trainer} + rollout_gpus {rollout} exceed the job's {v['gpus']} GPUs though they do not share them"
    if layout is not None:
        for column in ("tp", "pp", "ep"):
            if v.get(column) is not None and v[column] != layout[column]:
                return f"column {column} is {v[column]} but the training layout [TP,CP,EP,PP] gives {layout[column]}"
    degrees = [knobs.get(k) for k in ("trainer_tp", "trainer_pp", "trainer_dp")]
    if all(d is not None for d in degrees):
        product = math.prod(degrees) * int(knobs.get("trainer_cp") or 1)
        gpus = trainer or v["gpus"]
        if product != gpus:
            return f"tp x pp x dp x cp = {product}, not the trainer's {gpus} GPUs"
    return None


@dataclass
class ImportReport:
    """What an import did: one entry per row, and the counts."""

    file: str
    rows: list[tuple[int, str, str]] = field(default_factory=list)  # (row, run id, what happened)
    imported: int = 0
    already: int = 0
    failed: int = 0
    excluded: int = 0
    duplicates: int = 0

    def summary(self) -> dict[str, Any]:
        return {"file": self.file, "rows": len(self.rows), "imported": self.imported, "already_in_library": self.already,
                "failed": self.failed, "excluded": self.excluded, "same_measurement_twice": self.duplicates}


def read_rows(path: str | os.PathLike) -> list[ImportedRow]:
    """Every row of a public-runs CSV as a case, validated; the same measurement twice is kept once (the first row)."""
    out: list[ImportedRow] = []
    first_row: dict[str, int] = {}
    for run in read_public_runs(path):
        case = case_from_row(run)
        out.append(ImportedRow(run, case, first_row.get(case.run_id)))
        first_row.setdefault(case.run_id, run.row)
    return out


def _comparable(case: CaseRecord) -> dict[str, Any]:
    row = record_to_row(case)
    row.pop("provenance", None)
    row.pop("release", None)
    return row


def import_public_runs(path: str | os.PathLike, library: CaseLibrary) -> ImportReport:
    """Import a public-runs CSV into ``library``; see the module docstring. Nothing is written unless every row reads."""
    from rltune.contracts.cases import read_case_file
    from rltune.errors import ArtifactError
    from rltune.predict.library import case_file_name

    rows = read_rows(path)
    report = ImportReport(str(path))
    todo: list[ImportedRow] = []
    for item in rows:
        if item.duplicate_of is not None:
            continue
        existing = library.path / case_file_name(item.case.run_id)
        if existing.exists():
            try:
                stored = read_case_file(existing)
            except ArtifactError as exc:
                raise DuplicateCaseError(f"{path}: {item.run.where()}: its run {item.case.run_id!r} already has a file in "
                                         f"{library.path}, and it is unreadable ({exc.problem}); remove it and import again") from None
            if _comparable(stored) != _comparable(item.case):
                raise DuplicateCaseError(f"{path}: {item.run.where()}: run {item.case.run_id!r} is already in {library.path} with "
                                         "other content; nothing was imported")
        todo.append(item)
    for item in rows:
        case = item.case
        if item.duplicate_of is not None:
            report.duplicates += 1
            report.rows.append((item.run.row, case.run_id, f"the same measurement as row {item.duplicate_of}: kept once"))
            continue
        if (library.path / case_file_name(case.run_id)).exists() or not library.append(case):
            report.already += 1
            report.rows.append((item.run.row, case.run_id, "already in the library"))
            continue
        report.imported += 1
        if case.status != "ok":
            report.failed += 1
            report.rows.append((item.run.row, case.run_id, f"failed run, left out of fits: {case.excluded}"))
        elif case.excluded:
            report.excluded += 1
            report.rows.append((item.run.row, case.run_id, f"left out of fits: {case.excluded}"))
        else:
            report.rows.append((item.run.row, case.run_id, "imported"))
    return report


_SHIPPED: dict[str, list[CaseRecord]] = {}


def shipped_cases(directory: str | os.PathLike | None = None) -> list[CaseRecord]:
    """The public runs that install with rltune, read into memory once (each measurement once, first file first)."""
    where = Path(directory) if directory is not None else SHIPPED_DIR
    key = str(where)
    if key not in _SHIPPED:
        seen: set[str] = set()
        cases: list[CaseRecord] = []
        names = SHIPPED_FILES if directory is None else sorted(p.name for p in where.glob("*.csv"))
        for name in names:
            for item in read_rows(where / name):
                if item.case.run_id not in seen:
                    seen.add(item.case.run_id)
                    cases.append(item.case)
        _SHIPPED[key] = cases
    return _SHIPPED[key]


__all__ = ["ImportReport", "SHIPPED_DIR", "TRAINER_ONLY", "case_from_row", "device_name", "import_public_runs", "measurement_key",
           "read_rows", "shipped_cases"]
