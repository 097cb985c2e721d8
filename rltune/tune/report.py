"""``rltune report``: one self-contained HTML page about a tuning run, readable with no network.

The numbers come from an ``auto`` work directory's journal (journal.jsonl), which holds every
measured baseline and trial; or, for stages chained by hand (``rltune profile`` then ``trial``),
from the verdict.yaml files of the run directories under the given folder and the stage tables of
the baselines they name. Plots are drawn with matplotlib's Agg backend and embedded as base64 PNG;
the page links no script, stylesheet, font or image outside itself.
"""

from __future__ import annotations

import base64
import html
import io
from pathlib import Path
from typing import Any

from rltune.contracts.journal import event_as_data
from rltune.contracts.rundir import VERDICT_NAME, RunDir
from rltune.contracts.schema import atomic_write_text
from rltune.errors import RltuneError
from rltune.tune.journal import JournalState, check_recorded_runs, read_state
from rltune.tune.savings import shares_by_group

# The stages stacked in the per-round bars: they add up to the synchronous step (old_logprob is inside training).
PLOTTED_STAGES = ("rollout", "training", "weight_sync")
DECISION_COLORS = {"keep": "#2a9d3f", "reject": "#c98a0b", "failed": "#c0392b", "baseline": "#34495e"}


LEARNING_TEXT = {
    "unchanged": "not altered: no kept change alters what is learned per fresh sample",
    "unchecked": "UNCHECKED: kept changes alter what is learned per fresh sample and no reward check ran",
    "pass": "checked: the reward check passed",
    "fail": "FAILED the reward check: the change to blame is no longer proposed for this job",
}


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


def _legend(ax: Any, **options: Any) -> None:
    """A legend where the plot has labelled artists (matplotlib warns on an empty one)."""
    if ax.get_legend_handles_labels()[0]:
        ax.legend(**options)


def _table(header: list[str], rows: list[list[Any]]) -> str:
    def cell(value: Any) -> str:
        if isinstance(value, float):
            return f"{value:.4g}"
        return html.escape("" if value is None else str(value))

    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{cell(v)}</td>" for v in row) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def collect(workdir: str | Path) -> dict[str, Any]:
    """The numbers the report shows: start, baselines per round, trials, finish."""
    workdir = Path(workdir)
    if (workdir / "journal.jsonl").exists():
        state = read_state(workdir / "journal.jsonl")
        if not state.events:
            raise ReportError(f"{workdir / 'journal.jsonl'}: no events yet; run 'rltune auto' to the first baseline")
        check_recorded_runs(state, lambda text: Path(text) if Path(text).is_absolute() else workdir / text,
                            missing_ok=True)
        return _from_state(state)
    if workdir.is_dir():
        return _from_run_dirs(workdir)
    raise ReportError(f"{workdir}: no such directory; point 'rltune report' at an 'rltune auto' --workdir or at "
                      "the folder holding the run directories of 'rltune profile' and 'rltune trial'")


def _from_state(state: JournalState) -> dict[str, Any]:
    """The journal's replayed state as the plain records the page is drawn from."""
    def plain(event: Any) -> dict[str, Any] | None:
        return None if event is None else event_as_data(event)

    data = _assemble(plain(state.start) or {}, [plain(b) for b in state.baselines], [plain(t) for t in state.trials],
                     plain(state.finish))
    data["reward_check"] = plain(state.reward_check)
    return data


def _assemble(start: dict, baselines: list[dict], trials: list[dict], finish: dict | None) -> dict[str, Any]:
    rounds = []  # the baseline each round started from: the untuned run, then each kept trial
    if baselines:
        rounds.append({"round": 0, "label": "untuned", "run_id": baselines[0]["run_id"],
                       "step_s": baselines[0]["step_s"], "stages_s": baselines[0].get("stages_s", {})})
    for number, t in enumerate(trials, 1):
        t.setdefault("number", number)
        if t["decision"] == "keep":
            rounds.append({"round": t["round"], "label": f"#{t['number']} {t['candidate']}", "run_id": t["run_id"],
                           "step_s": t["step_s"], "stages_s": t.get("stages_s", {})})
    return {"start": start, "baselines": baselines, "trials": trials, "finish": finish, "rounds": rounds,
            "chained": "trial_budget" not in start}


def _from_run_dirs(folder: Path) -> dict[str, Any]:
    """Trials chained by hand: every verdict.yaml under ``folder`` (two levels deep), oldest first."""
    from rltune.contracts.verdict import load_verdict

    paths = sorted({*folder.glob(f"*/{VERDICT_NAME}"), *folder.glob(f"*/*/{VERDICT_NAME}"), *folder.glob(VERDICT_NAME)},
                   key=lambda p: (p.stat().st_mtime, str(p)))
    if not paths:
        raise ReportError(f"{folder}: no journal.jsonl and no run directory with a verdict.yaml under it; point "
                          "'rltune report' at an 'rltune auto' --workdir or at the folder 'rltune trial' wrote into "
                          "(--runs-root)")
    verdicts = [(p, load_verdict(p)) for p in paths]
    first = verdicts[0][1]
    start: dict[str, Any] = {"job": first.job, "job_name": Path(first.job).stem, "gpus": 0, "device": ""}
    job_file = Path(first.job)
    if job_file.exists():
        from rltune.contracts.job import load_job

        job = load_job(job_file)
        start.update(job_name=job.name, gpus=job.gpus.count, device=job.gpus.device, rl_mode=job.rl_mode)
    baselines = []
    untuned_dir = _find_run_dir(folder, first.untuned_run)
    if untuned_dir is not None:
        from rltune.profile.run import RecordedRun

        untuned = RecordedRun.from_dir(untuned_dir, first.untuned_run)
        baselines.append({"run_id": first.untuned_run, "step_s": untuned.step_s(), "stages_s": untuned.stage_means()})
    elif first.baseline_run == first.untuned_run and first.baseline_step_s is not None:
        baselines.append({"run_id": first.untuned_run, "step_s": first.baseline_step_s, "stages_s": {}})
    trials = []
    for path, v in verdicts:
        trials.append({"round": len([t for t in trials if t["decision"] == "keep"]) + 1, "run_id": v.run_id,
                       "candidate": v.candidate, "fixes": [], "group": "other", "decision": v.decision,
                       "reason": v.reason, "step_s": v.step_s, "baseline_step_s": v.baseline_step_s,
                       "gain_pct": v.gain_pct, "forecast_step_s": v.forecast_step_s,
                       "forecast_range_s": v.forecast_range_s, "stages_s": v.stages_s, "verdict": str(path)})
    return _assemble(start, baselines, trials, None)


def _find_run_dir(folder: Path, run_id: str) -> Path | None:
    for candidate in (folder / run_id, folder.parent / run_id, *folder.glob(f"*/{run_id}")):
        if RunDir(candidate).has_stages():
            return candidate
    return None


def _plots(data: dict[str, Any], devices: int) -> list[tuple[str, str, str]]:
    """(title, key, png) of each plot; GPU-seconds only for a job on GPUs (``devices`` > 0)."""
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
            ax.annotate(f"#{t['number']}", (i, t["step_s"]), textcoords="offset points", xytext=(4, 4), fontsize=7)
        if t["decision"] == "keep" and t.get("step_s") is not None:
            best_so_far = t["step_s"]
        xs.append(i)
        best.append(best_so_far)
    if untuned is not None:
        ax.scatter(0, untuned, color=DECISION_COLORS["baseline"], zorder=3)
        ax.step([0, *xs], [untuned, *best], where="post", color="#34495e", label="best kept so far")
    ax.set_xlabel("trial (0 = untuned baseline)")
    ax.set_ylabel("mean step time (s)")
    ax.set_title("Step time per trial: kept (green), rejected (amber), failed (red)")
    _legend(ax, loc="upper right")
    out.append(("Step time per round", "step", _png(fig)))

    if rounds:
        fig, ax = plt.subplots(figsize=(7, 3.4))
        labels = [r["label"] for r in rounds]
        bottom = [0.0] * len(rounds)
        for stage in PLOTTED_STAGES:
            heights = [float(r["stages_s"].get(stage) or 0.0) for r in rounds]
            ax.bar(labels, heights, bottom=bottom, label=stage)
            bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
        ax.plot(labels, [r["step_s"] for r in rounds], "k_", markersize=30, label="measured step")
        ax.set_ylabel("seconds (stage means)")
        ax.set_title("Stage split of each round's baseline")
        _legend(ax, fontsize=8)
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
        _legend(ax, fontsize=8)
        out.append(("Forecast vs measured", "forecast", _png(fig)))

    if rounds and devices > 0:
        fig, ax = plt.subplots(figsize=(7, 3))
        ax.bar([r["label"] for r in rounds], [r["step_s"] * devices for r in rounds], color="#5d6d7e")
        ax.set_ylabel(f"GPU-seconds per step ({devices} GPU{'s' if devices != 1 else ''})")
        ax.set_title("GPU-seconds per step of each round's baseline")
        plt.setp(ax.get_xticklabels(), rotation=15, ha="right")
        out.append(("GPU-seconds per step", "gpu_seconds", _png(fig)))
    return out


def _reward_section(workdir: Path, event: dict[str, Any]) -> list[str]:
    """The reward check of the tuned preset: both curves with the untuned seeds' band, and the verdict."""
    from rltune.tune.reward_check import curves_of, moving_average, seed_band

    path = Path(event["verdict"])
    path = path if path.is_absolute() else workdir / path
    parts = ["<h2>Reward check</h2>"]
    if not path.exists():
        return parts + [f"<p>{html.escape(event['decision'])}: {html.escape(event['reason'])} ({html.escape(str(path))} "
                        "is missing, so no curves)</p>"]
    check, curves = curves_of(path)
    parts.append(f"<p><b>{html.escape(check.decision.upper())}</b>: {html.escape(check.reason)}</p>")
    w = check.window
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.6))
    untuned = [r for r in check.runs if r.role == "untuned" and r.run_id in curves]
    if check.band is not None and len(untuned) >= 2:
        band = seed_band([curves[r.run_id] for r in untuned], w, check.band.z)
        xs = list(range(band.first_step, band.first_step + len(band.centre)))
        ax.fill_between(xs, [c - band.half_width for c in band.centre], [c + band.half_width for c in band.centre],
                        color="#34495e", alpha=0.15, label=f"untuned band (+-{band.half_width:.3g})")
    styles = {"untuned": ("#7f8c8d", "-", 1.0), "tuned": ("#2a9d3f" if check.passed else "#c0392b", "-", 2.0),
              "reverted": ("#c98a0b", "--", 1.2)}
    for run in check.runs:
        if run.run_id not in curves:
            continue
        color, line, width = styles[run.role]
        ma = moving_average(curves[run.run_id], w)
        ax.scatter(range(len(curves[run.run_id])), curves[run.run_id], s=3, color=color, alpha=0.25)
        ax.plot(range(w - 1, w - 1 + len(ma)), ma, line, color=color, linewidth=width, label=f"{run.run_id} ({run.role})")
    ax.set_xlabel("step")
    ax.set_ylabel(f"reward ({w}-step moving average; dots: steps)")
    ax.set_title("Reward: tuned against the untuned seeds' band")
    _legend(ax, fontsize=7, loc="lower right")
    parts.append(_img(_png(fig), "reward curves"))
    rows = [[r.run_id, r.role, r.seed, r.first_window_mean, r.final_window_mean, r.max_deviation, r.gap_mean,
             r.sample_age_mean, r.status] for r in check.runs]
    parts.append(_table(["run", "role", "seed", "first window", "final window", "max |deviation|", "gap",
                         "sample age", "status"], rows))
    if check.band is not None:
        b = check.band
        parts.append(_table(["", ""], [["rule", check.rule], ["half-width", b.half_width], ["sd used", b.sd],
                                       ["seed sd", b.seed_sd], ["step-noise sd", b.step_noise_sd],
                                       ["untuned rise", f"{b.centre_first:.4g} -> {b.centre_final:.4g}"],
                                       ["rise in half-widths", b.rise_in_bands]]))
    if check.attribution:
        parts.append("<p>The tuned setup re-run with each kept change undone:</p>")
        parts.append(_table(["change undone", "knobs set back", "run", "passes", "max |deviation|", "final window"],
                            [[a.change, ", ".join(f"{k}={v}" for k, v in a.reverted.items()), a.run_id,
                              "n/a" if a.passed is None else "yes" if a.passed else "no", a.max_deviation,
                              a.final_delta] for a in check.attribution]))
        blamed = ", ".join(check.blamed) or "no single change (undoing any one alone does not pass)"
        parts.append(f"<p>To blame: {html.escape(blamed)}</p>")
    for note in check.notes:
        parts.append(f"<p>Note: {html.escape(note)}</p>")
    return parts


def _range(value: list[float] | None) -> str:
    return f"{value[0]:.4g}-{value[1]:.4g}" if value else ""


def build_report(workdir: str | Path, out: str | Path | None = None) -> Path:
    """Write the report of the ``auto`` run in ``workdir`` and return its path (default workdir/report.html)."""
    workdir = Path(workdir)
    data = collect(workdir)
    start, finish, trials, rounds = data["start"], data["finish"], data["trials"], data["rounds"]
    devices = int(start.get("gpus") or 0)
    job_name = start.get("job_name", "job")

    kept = [(t.get("group", "other"), (t.get("baseline_step_s") or 0.0) - (t.get("step_s") or 0.0))
            for t in trials if t["decision"] == "keep"]
    shares = shares_by_group(kept)
    untuned = rounds[0]["step_s"] if rounds else None
    best = rounds[-1]["step_s"] if rounds else None

    parts = [f"<h1>Tuning {html.escape(job_name)}</h1>"]
    where = f"{devices} x {start.get('device', 'GPU')}" if devices else f"CPU only ({start.get('device') or 'cpu'})"
    summary = [["job", start.get("job", "")], ["RL mode (untuned)", start.get("rl_mode", "")], ["hardware", where],
               ["trials run", len(trials)], ["untuned mean step (s)", untuned], ["best mean step (s)", best]]
    if untuned and best:
        summary.append(["speed-up", f"{untuned / best:.2f}x"])
    if finish:
        summary += [["stopped because", finish.get("reason", "")], ["tuned preset", finish.get("tuned_preset", "")]]
        if finish.get("learning"):
            changes = "; ".join(finish.get("learning_changes") or [])
            summary.append(["learning", LEARNING_TEXT[finish["learning"]] + (f" ({changes})" if changes else "")])
    elif data["chained"]:
        summary.append(["runs", "chained by hand (rltune profile, trial)"])
    else:
        summary.append(["state", "still running or interrupted (no finish event yet)"])
    cost = None
    if not data["chained"]:
        from rltune.tune.cost import describe, run_dirs, run_wall_s, tuning_cost

        cost = tuning_cost(workdir, devices, untuned, best)
        summary.append(["tuning cost", describe(cost)])
    parts.append(_table(["", ""], summary))

    for title, _key, png in _plots(data, devices):
        parts.append(f"<h2>{html.escape(title)}</h2>{_img(png, title)}")

    if data.get("reward_check"):
        parts += _reward_section(workdir, data["reward_check"])

    if cost is not None:
        parts.append("<h2>What tuning cost</h2>")
        parts.append(f"<p>{html.escape(describe(cost))}. Every run of the work directory counts: the untuned "
                     "baselines, each trial and re-measurement, runs cut off by a kill (from their submission to "
                     "their last write) and the reward check's runs; each costs its wall time times the devices "
                     "the job holds (its GPUs, or one CPU host for a job without GPUs). Paid back after: device-"
                     "seconds spent / device-seconds a tuned step saves.</p>")
        rows = []
        for run_dir in run_dirs(workdir):
            wall, finished = run_wall_s(run_dir)
            rows.append([str(run_dir.relative_to(workdir)), round(wall, 1), "yes" if finished else "cut off"])
        parts.append(_table(["run", "wall s", "finished"], rows))

    parts.append("<h2>Savings by technique</h2>")
    if shares:
        parts.append("<p>Share of the job's total step-time saving from each kept change, counted under its main "
                     "fix's group. Shares follow the tuning path, not each technique alone.</p>")
        parts.append(_table(["job", *shares], [[job_name, *[round(v, 1) for v in shares.values()]]]))
    else:
        parts.append("<p>No change was kept, so there is no saving to split.</p>")

    parts.append("<h2>Trials</h2>")
    parts.append("<p>Step times are means over the steps both runs measured after warm-up: the wall time a "
                 "step costs.</p>")
    parts.append(_table(
        ["#", "round", "run", "fixes", "decision", "forecast (s)", "range (s)", "measured (s)", "baseline (s)",
         "gain %", "reason"],
        [[f"#{t['number']}", t["round"], t["run_id"], ", ".join(t.get("fixes", [])), t["decision"], t.get("forecast_step_s"),
          _range(t.get("forecast_range_s")), t.get("step_s"), t.get("baseline_step_s"), t.get("gain_pct"),
          t.get("reason", "")] for t in trials]))

    style = ("body{font-family:sans-serif;max-width:980px;margin:2em auto;color:#222}"
             "table{border-collapse:collapse;margin:1em 0;font-size:14px}"
             "td,th{border:1px solid #ccc;padding:4px 8px;text-align:left}img{max-width:100%}")
    page = (f"<!DOCTYPE html><html><head><meta charset=\"utf-8\"><title>rltune report: {html.escape(job_name)}</title>"
            f"<style>{style}</style></head><body>{''.join(parts)}</body></html>")
    path = Path(out) if out else workdir / "report.html"
    atomic_write_text(path, page)
    return path
