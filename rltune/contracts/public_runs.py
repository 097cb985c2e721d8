"""The public-runs CSV: measured runs of large jobs that other projects published, one row per run.

``rltune library import FILE.csv --library DIR`` reads this layout (:func:`read_public_runs`) and
:mod:`rltune.predict.public` turns each row into a case. The layout is the one of the extracted
measurements rltune ships (``rltune/predict/public/*.csv``): the setup in fixed columns (model,
GPUs, the GPU split, parallel degrees, batch), free-form settings in ``other_settings`` (``key=value``
pairs separated by ``; ``), the published times and throughput, and in ``notes`` where each number
comes from. An empty cell means the source does not publish it; it stays unknown.

Validation is strict and located: a header that lacks a column or names one the layout does not
have, a row with more or fewer cells than the header, a number that does not parse, is not finite or
is negative, a count that is not a whole positive number, an empty required cell -- each is one
:class:`~rltune.errors.MalformedFileError` naming the file, the row (its number among the data rows,
and the line it starts on) and the column.
"""

from __future__ import annotations

import csv
import io
import math
import os
from dataclasses import dataclass, field
from typing import Any

from rltune.errors import MalformedFileError

# (name, kind, doc). Kinds: 'text' (required), 'text?' (may be empty), 'number?' (a finite number >= 0,
# may be empty), 'positive' (a finite number > 0, required), 'count' (a whole number >= 1, required),
# 'count?' (a whole number >= 0, may be empty).
PUBLIC_RUN_COLUMNS: list[tuple[str, str, str]] = [
    ("source", "text", "who published the measurement (e.g. 'NeMo-RL performance-summary')"),
    ("model", "text", "model name as the source writes it"),
    ("params_b", "positive", "total parameters, billions"),
    ("active_params_b", "number?", "parameters active per token, billions (MoE models; empty: the source does not say)"),
    ("gpu", "text", "GPU type as the source writes it (e.g. 'H100-80GB (DGX-H100)')"),
    ("gpus", "count", "GPUs of the whole job"),
    ("trainer_gpus", "count?", "GPUs of the trainer (colocated jobs: all of them)"),
    ("rollout_gpus", "count?", "GPUs of the rollout engines (colocated jobs: all of them)"),
    ("tp", "count?", "trainer tensor-parallel degree"),
    ("pp", "count?", "trainer pipeline-parallel degree"),
    ("dp", "count?", "trainer data-parallel degree"),
    ("ep", "count?", "trainer expert-parallel degree"),
    ("batch_prompts", "count?", "prompts per step"),
    ("samples_per_prompt", "count?", "generations per prompt"),
    ("max_response_len", "count?", "cap on generated (or prompt + generated, per notes) tokens of a sample"),
    ("micro_batch", "count?", "trainer micro-batch (samples per GPU per forward/backward)"),
    ("rl_mode", "text", "how rollout and training interleave, in the source's words (sync colocated, async 1-step, trainer-only, ...)"),
    ("engine", "text?", "generation engine and trainer (e.g. 'vLLM (TP=2) + FSDP')"),
    ("other_settings", "text?", "further settings as 'key=value' pairs separated by '; ' (gen TP, precision, sequence lengths, release, ...)"),
    ("step_s", "number?", "published seconds per step"),
    ("rollout_s", "number?", "published rollout seconds per step"),
    ("train_s", "number?", "published training seconds per step"),
    ("sync_s", "number?", "published weight-sync seconds per step"),
    ("tokens_per_s", "number?", "published throughput (per GPU or for all GPUs: the source's unit, see notes)"),
    ("notes", "text?", "what each number is, its unit, and which values were filled from a recipe or derived"),
]
COLUMN_KINDS = {name: kind for name, kind, _ in PUBLIC_RUN_COLUMNS}
MAX_CELL_CHARS = 20_000  # a cell longer than this is a broken quote, not a setting
MAX_ROWS = 100_000


@dataclass
class PublicRun:
    """One data row: its typed cells (``None`` for an empty cell) and where it sits in the file."""

    file: str
    row: int  # 1-based among the data rows
    line: int  # line of the file the row starts on
    values: dict[str, Any] = field(default_factory=dict)

    def where(self, column: str | None = None) -> str:
        """The located field of an error about this row: 'row 3 (line 4), column step_s'."""
        here = f"row {self.row} (line {self.line})"
        return f"{here}, column {column}" if column else here

    def settings(self) -> dict[str, str]:
        """``other_settings`` as key -> value (parts without '=' are kept under their own text, value '')."""
        return parse_settings(self.values.get("other_settings") or "")


def parse_settings(text: str) -> dict[str, str]:
    """'a=1; b=x y; free text' -> {'a': '1', 'b': 'x y', 'free text': ''}; the first of a repeated key wins."""
    out: dict[str, str] = {}
    for part in text.split(";"):
        part = part.strip()
        if not part:
            continue
        key, sep, value = part.partition("=")
        key = key.strip()
        if key not in out:
            out[key] = value.strip() if sep else ""
    return out


def read_public_runs(path: str | os.PathLike) -> list[PublicRun]:
    """Read and validate a public-runs CSV; raise a located MalformedFileError on the first bad cell."""
    where = str(path)
    try:
        raw = open(where, "rb").read()
    except FileNotFoundError:
        raise MalformedFileError(where, "", "no such file; check the path") from None
    except OSError as exc:
        raise MalformedFileError(where, "", f"cannot be read ({exc.strerror or exc})") from None
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = raw[:exc.start].count(b"\n") + 1
        raise MalformedFileError(where, f"line {line}", "not UTF-8 text; save the CSV as UTF-8") from None
    if "\x00" in text:
        raise MalformedFileError(where, f"line {text[:text.index(chr(0))].count(chr(10)) + 1}", "holds a NUL byte: not a CSV text file")
    reader = csv.reader(io.StringIO(text, newline=""), strict=True)
    try:
        header = next(reader)
    except StopIteration:
        raise MalformedFileError(where, "header", "the file is empty; the first line must name the columns") from None
    except csv.Error as exc:
        raise MalformedFileError(where, "header", f"not valid CSV ({exc})") from None
    header = [h.strip() for h in header]
    _check_header(where, header)
    runs: list[PublicRun] = []
    line = reader.line_num + 1
    while True:
        try:
            cells = next(reader)
        except StopIteration:
            break
        except csv.Error as exc:
            raise MalformedFileError(where, f"row {len(runs) + 1} (line {line})", f"not valid CSV ({exc}); check its quotes") from None
        start, line = line, reader.line_num + 1
        if not cells or all(not c.strip() for c in cells):
            continue  # a blank line
        run = PublicRun(where, len(runs) + 1, start)
        if len(cells) != len(header):
            raise MalformedFileError(where, run.where(), f"has {len(cells)} cells, the header names {len(header)} columns; "
                                                         "quote cells that hold a comma")
        for name, cell in zip(header, cells, strict=True):
            run.values[name] = _cell(run, name, cell)
        _check_row(run)
        runs.append(run)
        if len(runs) > MAX_ROWS:
            raise MalformedFileError(where, run.where(), f"more than {MAX_ROWS} rows; split the file")
    if not runs:
        raise MalformedFileError(where, "", "holds a header and no rows; nothing to import")
    return runs


def _check_header(where: str, header: list[str]) -> None:
    seen: set[str] = set()
    for name in header:
        if name in seen:
            raise MalformedFileError(where, f"header, column {name}", "named twice; keep one")
        seen.add(name)
        if name not in COLUMN_KINDS:
            import difflib

            close = difflib.get_close_matches(name, list(COLUMN_KINDS), n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise MalformedFileError(where, f"header, column {name}", f"not a column of the public-runs layout{hint}; "
                                                                     f"expected {', '.join(COLUMN_KINDS)}")
    missing = [name for name in COLUMN_KINDS if name not in seen]
    if missing:
        raise MalformedFileError(where, f"header, column {missing[0]}", "missing; every column of the layout must be named "
                                                                      "(leave its cells empty where the source does not publish it)")


def _cell(run: PublicRun, name: str, cell: str) -> Any:
    kind = COLUMN_KINDS[name]
    text = cell.strip()
    if len(text) > MAX_CELL_CHARS:
        raise MalformedFileError(run.file, run.where(name), f"{len(text)} characters long; a cell is at most {MAX_CELL_CHARS} "
                                                            "(an unclosed quote?)")
    if not text:
        if kind in ("text", "positive", "count"):
            raise MalformedFileError(run.file, run.where(name), "empty, and this column is required")
        return None
    if kind in ("text", "text?"):
        return text
    try:
        value = float(text)
    except ValueError:
        raise MalformedFileError(run.file, run.where(name), f"expected a number, found {text!r}") from None
    if not math.isfinite(value):
        raise MalformedFileError(run.file, run.where(name), f"expected a finite number, found {text!r}")
    if value < 0:
        raise MalformedFileError(run.file, run.where(name), f"must not be negative, found {text}")
    if kind == "positive" and value <= 0:
        raise MalformedFileError(run.file, run.where(name), f"must be positive, found {text}")
    if kind in ("count", "count?"):
        if value != int(value):
            raise MalformedFileError(run.file, run.where(name), f"expected a whole number, found {text}")
        if kind == "count" and value < 1:
            raise MalformedFileError(run.file, run.where(name), f"must be at least 1, found {text}")
        return int(value)
    return value


def _check_row(run: PublicRun) -> None:
    v = run.values
    active, total = v.get("active_params_b"), v.get("params_b")
    if active is not None and active <= 0:
        raise MalformedFileError(run.file, run.where("active_params_b"), f"must be positive, found {active:g}")
    if active is not None and total is not None and active > total * (1 + 1e-9):
        raise MalformedFileError(run.file, run.where("active_params_b"), f"{active:g} B active exceeds params_b ({total:g} B)")
    for name in ("trainer_gpus", "rollout_gpus"):
        if v.get(name) is not None and v[name] > v["gpus"]:
            raise MalformedFileError(run.file, run.where(name), f"{v[name]} exceeds the job's gpus ({v['gpus']})")


def describe_columns() -> str:
    """Markdown table of the layout, for docs/artifacts.md."""
    kinds = {"text": "text, required", "text?": "text", "number?": "number >= 0", "positive": "number > 0, required",
             "count": "whole number >= 1, required", "count?": "whole number >= 0"}
    lines = ["| column | type | meaning |", "|---|---|---|"]
    lines += [f"| `{n}` | {kinds[k]} | {d} |" for n, k, d in PUBLIC_RUN_COLUMNS]
    return "\n".join(lines)


__all__ = ["PUBLIC_RUN_COLUMNS", "PublicRun", "describe_columns", "parse_settings", "read_public_runs"]
