"""The sandbox-host knob on a CPU: at a fixed number of concurrent sandboxes, one host against several.

Each arm runs the same tool-use trials -- open a sandbox on a host (a 24-module image built and
byte-compiled), run ``--execs`` commands each followed by ``--tests`` of the task's test cases
(real CPU and file work), close it -- ``--concurrency`` at a time from threads, through
:class:`rltune.workload.sandbox_hosts.SandboxHosts`: the same client, host processes and protocol
the workload uses. The arms differ only in how those sandboxes are spread: ``1x`` puts them all on
one host pinned to ``--cores-per-host`` CPUs, ``Nx`` spreads them over N hosts with as many CPUs
each (the sandboxes per host divided by N). Every ``--batch`` trials make a "step": its wall time,
the mean trial time, and each host's load, queue wait and file-system time, as the workload's
stage table writes them; ``sandbox_hosts_overloaded`` (rltune.profile.detectors) is run on each
arm's steps. Arms alternate per round, so a load change on this shared machine hits all of them.

Usage (CPU)::

    python bench/sandbox_hosts.py --concurrency 2,8 --hosts 1,2 --rounds 3 \\
        --out bench/results/sandbox_hosts-cpu-<git>.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

from workload_vllm_sync import REPO, LoadSampler, device, stats, versions

from rltune.sync.bench import git_sha
from rltune.workload.sandbox import ImageSpec, SandboxLimits
from rltune.workload.sandbox_hosts import SandboxHosts

LIMITS = SandboxLimits(cpu_s=60, memory_mb=512, wall_s=120.0)


def trial(hosts: SandboxHosts, args, out: list[dict], lock: threading.Lock) -> None:
    start = time.perf_counter()
    with hosts.sandbox({"data.txt": "3 4 5\n"}) as box:
        for _ in range(args.execs):
            box.execute("sum data.txt", tests=args.tests)
        setup, queue, execs = box.setup_s, box.queue_s, box.exec_s
    with lock:
        out.append(dict(host=box.host, trial_s=time.perf_counter() - start, setup_s=setup, queue_s=queue,
                        exec_s=execs, fs_s=box.fs_s))


def run_step(hosts: SandboxHosts, args, concurrency: int) -> list[dict]:
    """``args.batch`` trials, ``concurrency`` at a time; each trial's figures."""
    done: list[dict] = []
    lock = threading.Lock()
    pending = list(range(args.batch))

    def worker() -> None:
        while True:
            with lock:
                if not pending:
                    return
                pending.pop()
            trial(hosts, args, done, lock)

    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return done


def run_arm(n_hosts: int, concurrency: int, args) -> dict:
    """One arm: ``concurrency`` sandboxes over ``n_hosts`` hosts, ``args.batches`` steps of ``args.batch`` trials."""
    per_host = concurrency // n_hosts
    hosts = SandboxHosts(n_hosts, per_host, LIMITS, ImageSpec(modules=args.modules), cores_per_host=args.cores_per_host)
    rows = []
    try:
        for step in range(args.batches):
            hosts.host_stats()  # the step's window starts here
            start = time.perf_counter()
            done = run_step(hosts, args, concurrency)
            wall = time.perf_counter() - start
            host_stats = hosts.host_stats()
            loads = [s["load"] for s in host_stats if s is not None and s["busy_frac"] > 0]
            rows.append(dict(step=step, step_s=wall, rollout_s=wall, training_s=0.0, weight_sync_s=0.0,
                             trials_total=float(len(done)), trials_cut_off=0.0, trials_failed=0.0,
                             sandbox_setup_s=statistics.fmean(d["setup_s"] for d in done),
                             sandbox_exec_s=statistics.fmean(d["exec_s"] for d in done),
                             sandbox_queue_s=statistics.fmean(d["queue_s"] for d in done),
                             sandbox_fs_s=statistics.fmean(d["fs_s"] for d in done),
                             sandbox_host_load=max(loads) if loads else None,
                             sandbox_hosts=float(n_hosts),
                             trial_s_mean=statistics.fmean(d["trial_s"] for d in done),
                             trial_s_median=statistics.median(d["trial_s"] for d in done),
                             trial_s_max=max(d["trial_s"] for d in done),
                             **{f"sandbox_host/{i}/load": s["load"] for i, s in enumerate(host_stats) if s}))
        cores = [h.cores for h in hosts.hosts]
    finally:
        hosts.close()
    return dict(hosts=n_hosts, per_host=per_host, concurrency=concurrency, cores=cores, rows=rows)


def detect(rows: list[dict], warmup: int) -> list[dict]:
    """What the detectors name on an arm's steps (its stage table, as the workload would write it)."""
    from rltune.contracts.stages import rows_to_table
    from rltune.profile.diagnose import diagnose

    table = rows_to_table([dict(run_id="bench", warmup=r["step"] < warmup, **r) for r in rows], "rltune")
    diagnosis = diagnose(table, "sync", warmup_steps=warmup)
    return [dict(id=p.id, severity=p.severity, summary=p.summary) for p in diagnosis.problems]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", default="2,8", help="sandboxes at once, comma-separated (each a group of arms)")
    ap.add_argument("--hosts", default="1,2", help="host counts to compare at each concurrency")
    ap.add_argument("--cores-per-host", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batches", type=int, default=3, help="steps per arm and round")
    ap.add_argument("--batch", type=int, default=16, help="trials per step")
    ap.add_argument("--execs", type=int, default=3, help="commands per trial")
    ap.add_argument("--tests", type=int, default=60, help="test cases after each command (about 1.3 ms each here)")
    ap.add_argument("--modules", type=int, default=24, help="library modules of the image built for each trial")
    ap.add_argument("--warmup", type=int, default=1, help="steps of each arm left out of the statistics")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    concurrencies = [int(c) for c in args.concurrency.split(",")]
    host_counts = [int(h) for h in args.hosts.split(",")]
    runs = []
    with LoadSampler() as load:
        for r in range(args.rounds):
            for c in concurrencies:
                for n in host_counts:
                    if c % n:
                        continue
                    arm = run_arm(n, c, args)
                    runs.append(dict(round=r, **arm))
                    kept = [row for row in arm["rows"] if row["step"] >= args.warmup]
                    print(f"round {r}: {c} sandboxes on {n} host(s): step {statistics.median(x['step_s'] for x in kept):.2f} s, "
                          f"trial {statistics.median(x['trial_s_mean'] for x in kept):.3f} s, "
                          f"load {statistics.median(x['sandbox_host_load'] for x in kept):.2f}", flush=True)

    summary = {}
    for c in concurrencies:
        for n in host_counts:
            arm_runs = [x for x in runs if x["concurrency"] == c and x["hosts"] == n]
            if not arm_runs:
                continue
            kept = [row for x in arm_runs for row in x["rows"] if row["step"] >= args.warmup]
            pooled = [row for x in arm_runs for row in x["rows"]]
            summary[f"c{c}-h{n}"] = dict(
                concurrency=c, hosts=n, per_host=c // n, cores=arm_runs[0]["cores"],
                **{col: stats([row[col] for row in kept]) for col in (
                    "step_s", "trial_s_mean", "trial_s_median", "trial_s_max", "sandbox_setup_s", "sandbox_exec_s",
                    "sandbox_queue_s", "sandbox_fs_s", "sandbox_host_load")},
                problems=detect(pooled, args.warmup))
    ratios = {}
    for c in concurrencies:
        one = summary.get(f"c{c}-h1")
        for n in host_counts:
            other = summary.get(f"c{c}-h{n}")
            if one and other and n != 1:
                ratios[f"c{c}: 1 host / {n} hosts"] = dict(
                    step_s=one["step_s"]["median"] / other["step_s"]["median"],
                    trial_s=one["trial_s_mean"]["median"] / other["trial_s_mean"]["median"])
    record = dict(bench="sandbox_hosts", git=git_sha(REPO), device=device(), versions=versions(),
                  config={k: v for k, v in vars(args).items() if k != "out"}, load_1min=stats(load.samples),
                  summary=summary, one_over_many_median=ratios, runs=runs, time=time.strftime("%Y-%m-%dT%H:%M:%S"))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    for name, arm in summary.items():
        fired = [p["id"] for p in arm["problems"] if p["id"] == "sandbox_hosts_overloaded"]
        print(f"{name}: step {arm['step_s']['median']:.2f} s, trial {arm['trial_s_mean']['median']:.3f} s, "
              f"load {arm['sandbox_host_load']['median']:.2f}, overloaded: {'yes' if fired else 'no'}")
    print(json.dumps(ratios), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
