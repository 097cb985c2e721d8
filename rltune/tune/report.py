"""``rltune report``: one self-contained HTML page about an ``auto`` run, readable with no network.

Everything comes from the run's journal (journal.jsonl), which holds every measured baseline and
trial. Plots are drawn with matplotlib's Agg backend and embedded as base64 PNG; the page links no
script, stylesheet, font or image outside itself.
"""

from __future__ import annotations

import base64
import html
import io
from pathlib import Path
from typing import Any

from rltune.contracts.schema import atomic_write_text
from rltune.errors import RltuneError
from rltune.tune.journal import Journal
from rltune.tune.savings import shares_by_group

STAGES = ("rollout", "training", "weight_sync")
DECISION_COLORS = {"keep": "#2a9d3f", "reject": "#c98a0b", "failed": "#c0392b", "baseline": "#34495e"}


class ReportError(RltuneError):
    """The directory holds no auto run to report on."""


def _png(fig: Any) -> str:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=96, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)
    return base64.b64encode(buffer.getvalue()).decode()


def _img(data: str, alt: str) -> str:
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{data}">'


def _table(header: list[str], rows: list[list[Any]]) -> str:
    def cell(value: Any) -> str:
        if isinstance(value, float):
            return f"{value:.4g}"
        return html.escape("" if value is None else str(value))

    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{cell(v)}</td>" for v in row) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def collect(workdir: str | Path) -> dict[str, Any]:
    """The numbers the report shows, from the journal: start, baselines per round, trials, finish."""
    events = Journal(Path(workdir) / "journal.jsonl").events()
    if not events:
        raise ReportError(f"{workdir}: no journal.jsonl with events; point 'rltune report' at an 'rltune auto' --workdir")
    start = next((e for e in events if e["event"] == "start"), {})
    baselines = [e for e in events if e["event"] == "baseline"]
    trials = [e for e in events if e["event"] == "trial"]
    finish = next((e for e in reversed(events) if e["event"] == "finish"), None)
    rounds = []  # the baseline each round started from: the untuned run, then each kept trial
    if baselines:
        rounds.append({"round": 0, "label": "untuned", "run_id": baselines[0]["run_id"],
                       "step_s": baselines[0]["step_s"], "stages_s": baselines[0].get("stages_s", {})})
    for t in trials:
        if t["decision"] == "keep":
            rounds.append({"round": t["round"], "label": f"r{t['round']} {t['candidate']}", "run_id": t["run_id"],
                           "step_s": t["step_s"], "stages_s": t.get("stages_s", {})})
    return {"start": start, "baselines": baselines, "trials": trials, "finish": finish, "rounds": rounds}


def _plots(data: dict[str, Any], devices: int) -> list[tuple[str, str, str]]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = []
    rounds, trials = data["rounds"], data["trials"]
    untuned = rounds[0]["step_s"] if rounds else None

    fig, ax = plt.subplots(figsize=(7, 3.4))
    xs, best, best_so_far = [], [], untuned
    for i, t in enumerate(trials, 1):
        if t.get("step_s") is not None:
            ax.scatter(i, t["step_s"], color=DECISION_COLORS.get(t["decision"], "grey"), zorder=3)
        if t["decision"] == "keep" and t.get("step_s") is not None:
            best_so_far = t["step_s"]
        xs.append(i)
        best.append(best_so_far)
    if untuned is not None:
        ax.scatter(0, untuned, color=DECISION_COLORS["baseline"], zorder=3)
        ax.step([0, *xs], [untuned, *best], where="post", color="#34495e", label="best kept so far")
    ax.set_xlabel("trial (0 = untuned baseline)")
    ax.set_ylabel("median step time (s)")
    ax.set_title("Step time per trial: kept (green), rejected (amber), failed (red)")
    ax.legend(loc="upper right")
    out.append(("Step time per round", "step", _png(fig)))

    if rounds:
        fig, ax = plt.subplots(figsize=(7, 3.4))
        labels = [r["label"] for r in rounds]
        bottom = [0.0] * len(rounds)
        for stage in STAGES:
            heights = [float(r["stages_s"].get(stage) or 0.0) for r in rounds]
            ax.bar(labels, heights, bottom=bottom, label=stage)
            bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
        ax.plot(labels, [r["step_s"] for r in rounds], "k_", markersize=30, label="measured step")
        ax.set_ylabel("seconds (stage medians)")
        ax.set_title("Stage split of each round's baseline")
        ax.legend(fontsize=8)
        plt.setp(ax.get_xticklabels(), rotation=15, ha="right")
        out.append(("Stage split per round", "stages", _png(fig)))

    forecast = [t for t in trials if t.get("forecast_step_s") is not None and t.get("step_s") is not None]
    if forecast:
        fig, ax = plt.subplots(figsize=(4.6, 4.2))
        for t in forecast:
            lo, hi = t.get("forecast_range_s") or (t["forecast_step_s"], t["forecast_step_s"])
            ax.errorbar(t["forecast_step_s"], t["step_s"], xerr=[[t["forecast_step_s"] - lo], [hi - t["forecast_step_s"]]],
                        fmt="o", color=DECISION_COLORS.get(t["decision"], "grey"))
        values = [v for t in forecast for v in (t["forecast_step_s"], t["step_s"])]
        lo, hi = min(values) * 0.9, max(values) * 1.1
        ax.plot([lo, hi], [lo, hi], "k--", linewidth=1)
        ax.fill_between([lo, hi], [lo * 0.9, hi * 0.9], [lo * 1.1, hi * 1.1], color="grey", alpha=0.15, label="within 10%")
        ax.set_xlabel("forecast step (s)")
        ax.set_ylabel("measured step (s)")
        ax.set_title("Forecast vs measured")
        ax.legend(fontsize=8)
        out.append(("Forecast vs measured", "forecast", _png(fig)))

    if rounds:
        fig, ax = plt.subplots(figsize=(7, 3))
        ax.bar([r["label"] for r in rounds], [r["step_s"] * devices for r in rounds], color="#5d6d7e")
        ax.set_ylabel(f"device-seconds per step ({devices} device{'s' if devices != 1 else ''})")
        ax.set_title("GPU-seconds per step of each round's baseline")
        plt.setp(ax.get_xticklabels(), rotation=15, ha="right")
        out.append(("GPU-seconds per step", "gpu_seconds", _png(fig)))
    return out


def build_report(workdir: str | Path, out: str | Path | None = None) -> Path:
    """Write the report of the ``auto`` run in ``workdir`` and return its path (default workdir/report.html)."""
    workdir = Path(workdir)
    data = collect(workdir)
    start, finish, trials, rounds = data["start"], data["finish"], data["trials"], data["rounds"]
    devices = max(int(start.get("gpus") or 0), 1)
    job_name = start.get("job_name", "job")

    kept = [(t.get("group", "other"), (t.get("baseline_step_s") or 0.0) - (t.get("step_s") or 0.0))
            for t in trials if t["decision"] == "keep"]
    shares = shares_by_group(kept)
    untuned = rounds[0]["step_s"] if rounds else None
    best = rounds[-1]["step_s"] if rounds else None

    parts = [f"<h1>rltune auto: {html.escape(job_name)}</h1>"]
    summary = [["job", start.get("job", "")], ["RL mode (untuned)", start.get("rl_mode", "")],
               ["devices", f"{start.get('gpus', 0)} x {start.get('device', '')}"],
               ["trials run", len(trials)], ["untuned step (s)", untuned], ["best step (s)", best]]
    if untuned and best:
        summary.append(["speed-up", f"{untuned / best:.2f}x"])
    if finish:
        summary += [["stopped because", finish.get("reason", "")], ["tuned preset", finish.get("tuned_preset", "")]]
    else:
        summary.append(["state", "still running or interrupted (no finish event yet)"])
    parts.append(_table(["", ""], summary))

    for title, _key, png in _plots(data, devices):
        parts.append(f"<h2>{html.escape(title)}</h2>{_img(png, title)}")

    parts.append("<h2>Savings by technique (the seed's Figure 8)</h2>")
    if shares:
        parts.append("<p>Share of the job's total step-time saving from each kept change, counted under its main "
                     "fix's group. Shares follow the tuning path, not each technique alone.</p>")
        parts.append(_table(["job", *shares], [[job_name, *[round(v, 1) for v in shares.values()]]]))
    else:
        parts.append("<p>No change was kept, so there is no saving to split.</p>")

    parts.append("<h2>Trials</h2>")
    parts.append(_table(
        ["round", "candidate", "fixes", "decision", "forecast (s)", "measured (s)", "baseline (s)", "gain %", "reason"],
        [[t["round"], t["candidate"], ", ".join(t.get("fixes", [])), t["decision"], t.get("forecast_step_s"),
          t.get("step_s"), t.get("baseline_step_s"), t.get("gain_pct"), t.get("reason", "")] for t in trials]))

    style = ("body{font-family:sans-serif;max-width:980px;margin:2em auto;color:#222}"
             "table{border-collapse:collapse;margin:1em 0;font-size:14px}"
             "td,th{border:1px solid #ccc;padding:4px 8px;text-align:left}img{max-width:100%}")
    page = (f"<!DOCTYPE html><html><head><meta charset=\"utf-8\"><title>rltune report: {html.escape(job_name)}</title>"
            f"<style>{style}</style></head><body>{''.join(parts)}</body></html>")
    path = Path(out) if out else workdir / "report.html"
    atomic_write_text(path, page)
    return path
