"""profile_job and the CLI end to end on a small real job: a Python script doing real hashing work per
stage, timing it with perf_counter and writing metrics.jsonl in the rltune format."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from launch.jobfile import write_job

from rltune.cli.main import main
from rltune.contracts.diagnosis import load_diagnosis
from rltune.contracts.job import load_job
from rltune.contracts.stages import read_stages
from rltune.errors import LaunchError, LogFormatError
from rltune.profile import profile_job
from rltune.profile.adapters import vllm

# Rollout hashes 4x the rounds training does, so rollout limits a sync step by construction.
JOB = """
import hashlib, json, sys, time
from pathlib import Path
args = sys.argv[1:]
run_dir = Path(args[args.index('--run-dir') + 1])
over = dict(a.split('=', 1) for a in args if '=' in a)
steps = int(over.get('orchestrator.steps', args[args.index('--steps') + 1]))
crash_after = int(over.get('trainer.crash_after', -1))

def work(rounds):
    t = time.perf_counter()
    h = b'x'
    for _ in range(rounds):
        h = hashlib.sha256(h).digest()
    return time.perf_counter() - t

with open(run_dir / 'metrics.jsonl', 'a') as out:
    for step in range(steps):
        if step == crash_after:
            print(f'RuntimeError: trainer died at step {step}', flush=True)
            sys.exit(3)
        t0 = time.perf_counter()
        rollout, training, sync = work(80000), work(20000), work(4000)
        row = dict(step=step, step_s=time.perf_counter() - t0, rollout_s=rollout, training_s=training,
                   weight_sync_s=sync, reward=0.5)
        out.write(json.dumps(row) + '\\n')
        out.flush()
        print(f'step {step} done', flush=True)
"""


def job_file(tmp_path, **launch):
    return write_job(tmp_path, JOB, knobs={"crash_after": -1},
                     launch={"knob_map": {"micro_batch_size": "trainer.micro_batch_size",
                                          "crash_after": "trainer.crash_after"}, **launch})


def test_profile_job_writes_the_run_dir_and_names_the_heaviest_stage(tmp_path):
    path = job_file(tmp_path)
    result = profile_job(path, tmp_path / "run", steps=4)
    run_dir = result.run_dir
    assert result.launch.ok
    table = read_stages(run_dir / "stages.parquet")
    assert table.column("step").to_pylist() == [0, 1, 2, 3]
    assert table.column("warmup").to_pylist() == [True, False, False, False]  # limits.warmup_steps = 1
    assert table.column("run_id").to_pylist() == ["run"] * 4
    diagnosis = load_diagnosis(run_dir / "diagnosis.yaml")
    assert diagnosis.steps_used == [1, 2, 3]
    assert diagnosis.limiting_stage == "rollout"
    assert diagnosis.stage_medians_s["rollout"] > 2 * diagnosis.stage_medians_s["training"] > 0
    assert diagnosis.job == "job.yaml" and load_job(run_dir / "job.yaml").limits.steps == 4


def test_a_crash_raises_with_the_log_tail_and_keeps_the_steps_written(tmp_path):
    path = job_file(tmp_path)
    with pytest.raises(LaunchError) as info:
        profile_job(path, tmp_path / "run", steps=5, overrides={"crash_after": 2})
    message = str(info.value)
    assert "exited with code 3" in message and "2 steps saved" in message
    assert message.splitlines()[-1] == "RuntimeError: trainer died at step 2"
    assert read_stages(tmp_path / "run" / "stages.parquet").num_rows == 2
    assert load_job(tmp_path / "run" / "job.yaml").knobs["crash_after"] == 2


def test_a_job_that_writes_no_metrics_failed_and_says_where_it_looked(tmp_path):
    from rltune.profile.run import JobFailedError

    path = write_job(tmp_path, "print('trained, but logged nothing')\n")
    with pytest.raises(JobFailedError, match="metrics.path") as caught:
        profile_job(path, tmp_path / "run", steps=2)
    assert caught.value.exit_code == 4  # it measured nothing: the job's failure, as a trial of it records


class _Metrics(BaseHTTPRequestHandler):
    body = b""
    hits = 0

    def do_GET(self):  # noqa: N802 (http.server API)
        type(self).hits += 1
        # Each scrape sees 2 more preemptions and 3 more queued requests of 0.5 s each.
        n = type(self).hits
        text = (f"# TYPE vllm:num_preemptions_total counter\nvllm:num_preemptions_total {2 * n}\n"
                "# TYPE vllm:request_queue_time_seconds histogram\n"
                f'vllm:request_queue_time_seconds_bucket{{le="1.0"}} {3 * n}\n'
                f'vllm:request_queue_time_seconds_bucket{{le="+Inf"}} {3 * n}\n'
                f"vllm:request_queue_time_seconds_sum {1.5 * n}\nvllm:request_queue_time_seconds_count {3 * n}\n"
                "# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc 0.5\n").encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.end_headers()
        self.wfile.write(text)

    def log_message(self, *args):
        pass


@pytest.fixture
def metrics_server():
    _Metrics.hits = 0
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Metrics)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/metrics"
    server.shutdown()
    server.server_close()


def test_live_scrape_parses_the_endpoint_and_deltas_are_per_interval(metrics_server):
    first, second = vllm.scrape(metrics_server), vllm.scrape(metrics_server)
    assert first["vllm:num_preemptions_total"] == 2.0 and second["vllm:num_preemptions_total"] == 4.0
    step = vllm.delta(first, second)
    assert step["vllm:num_preemptions_total"] == 2.0
    assert step["vllm:request_queue_time_seconds/count"] == 3.0
    assert step["vllm:request_queue_time_seconds/mean"] == pytest.approx(0.5)
    assert step["vllm:kv_cache_usage_perc"] == 0.5


def test_scraping_a_dead_endpoint_is_a_clear_error():
    with pytest.raises(LogFormatError, match="cannot scrape"):
        vllm.scrape("http://127.0.0.1:9/metrics", timeout_s=0.5)
    with pytest.raises(LogFormatError, match="not an http"):
        vllm.scrape("file:///etc/passwd")


def test_profile_job_attaches_engine_metrics_scraped_per_step(tmp_path, metrics_server):
    import yaml

    path = job_file(tmp_path)
    data = yaml.safe_load(path.read_text())
    data["metrics"] = {"format": "rltune", "path": "{run_dir}/metrics.jsonl", "vllm_metrics_url": metrics_server}
    path.write_text(yaml.safe_dump(data))
    result = profile_job(path, tmp_path / "run", steps=3)
    rows = result.table.to_pylist()
    scraped = [r for r in rows if r["engine_preemptions"] is not None]
    assert scraped, "no step got engine metrics"
    for r in scraped:
        assert r["engine_preemptions"] % 2 == 0 and r["engine_preemptions"] >= 2
        assert r["engine_queue_s"] == pytest.approx(0.5)
        assert r["kv_cache_usage"] == 0.5


def test_cli_profile_json_summary_and_exit_codes(tmp_path, capsys):
    path = job_file(tmp_path)
    out = tmp_path / "cli-run"
    assert main(["profile", str(path), "--steps", "3", "--out", str(out), "--set", "micro_batch_size=8", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["diagnosis"]["limiting_stage"] == "rollout"
    assert summary["diagnosis"]["steps_used"] == [1, 2]
    assert load_job(out / "job.yaml").knobs["micro_batch_size"] == 8
    assert main(["profile", str(path), "--set", "tp_size=2", "--out", str(tmp_path / "x")]) == 2
    assert f"--set (job {path}): tp_size: not a knob of job 'launch-test'" in capsys.readouterr().err


def test_cli_from_logs_writes_table_report_and_diagnosis(tmp_path, capsys):
    data = Path(__file__).parent / "data"
    out = tmp_path / "verl"
    rc = main(["profile", "--from-logs", str(data / "verl_timing_s_qwen2-7b_grpo_fsdp_steps12.log"),
               "--format", "auto", "--rl-mode", "sync", "--out", str(out), "--json"])
    captured = capsys.readouterr()
    assert rc == 0
    summary = json.loads(captured.out)
    assert summary["report"]["format"] == "verl" and summary["report"]["steps"] == 11
    assert summary["diagnosis"]["limiting_stage"] == "training"
    assert summary["diagnosis"]["problems"][0]["id"] == "old_logprob_pass_costly"
    assert "limiting stage" in captured.err
    assert read_stages(out / "stages.parquet").num_rows == 11
    assert json.loads((out / "parse_report.json").read_text())["lines_skipped"] == 1
    assert load_diagnosis(out / "diagnosis.yaml").rl_mode == "sync"
    assert main(["profile", "--from-logs", str(data / "trl_grpo_console_memgen_pr33.log"), "--out",
                 str(tmp_path / "trl")]) == 0
    assert "no diagnosis" in capsys.readouterr().err
    assert main(["profile"]) == 2
