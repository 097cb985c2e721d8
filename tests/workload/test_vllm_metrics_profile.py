"""``rltune profile --vllm-metrics URL`` against a real ``vllm serve`` on 127.0.0.1.

The job is a small client: each step it sends requests to the server's token-in/token-out route, then
scrapes ``/metrics`` itself and saves the text, then writes the step's line (step and rollout time,
no engine columns) and waits, so the profiler's own scrape of that step sees the same idle server.
The columns the profiler fills must be the server's figures: those two direct scrapes differenced
and mapped, and they must agree with what the client itself counted (requests, generated tokens).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from launch.jobfile import write_job

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "sync"))
from vllm_helpers import requires_vllm, vllm_server  # noqa: E402

from rltune.cli.main import main  # noqa: E402
from rltune.contracts.job import load_job  # noqa: E402
from rltune.contracts.stages import read_stages  # noqa: E402

pytestmark = requires_vllm

REQUESTS_PER_STEP = 6
CLIENT = f"N = {REQUESTS_PER_STEP}\n" + """
import json, sys, time, urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
args = sys.argv[1:]
url, run_dir = args[args.index('--url') + 1], Path(args[args.index('--run-dir') + 1])
steps = int(args[args.index('--steps') + 1])

def post(path, body):
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(), headers={'Content-Type': 'application/json'})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())

def scrape(name):
    with urllib.request.urlopen(url + '/metrics', timeout=10) as resp:
        (run_dir / name).write_text(resp.read().decode())

def one(i):
    body = dict(token_ids=[1, 5 + i, 7, 9], sampling_params=dict(max_tokens=8 + i, temperature=1.0, ignore_eos=True))
    return len(post('/inference/v1/generate', body)['choices'][0]['token_ids'])

scrape('direct-start.prom')
with open(run_dir / 'metrics.jsonl', 'a') as out, ThreadPoolExecutor(8) as pool:
    for step in range(steps):
        t0 = time.perf_counter()
        tokens = sum(pool.map(one, range(N)))
        rollout = time.perf_counter() - t0
        scrape(f'direct-{step}.prom')
        (run_dir / f'client-{step}.json').write_text(json.dumps(dict(requests=N, tokens=tokens)))
        out.write(json.dumps(dict(step=step, step_s=time.perf_counter() - t0, rollout_s=rollout)) + '\\n')
        out.flush()
        time.sleep(1.5)  # the profiler scrapes within 0.5 s of seeing the line; the server stays idle meanwhile
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """vllm serve of a tiny random model on 127.0.0.1, and its base URL."""
    import torch

    from rltune.workload.engine_vllm import write_boot_checkpoint
    from rltune.workload.model import build_model

    work = tmp_path_factory.mktemp("serve")
    boot = write_boot_checkpoint(build_model("tiny", 0, torch.float32), work / "boot", torch.bfloat16)
    with vllm_server(boot, work / "serve.log", "--enable-scale-out") as url:
        yield url


def test_profile_fills_the_engine_columns_with_the_servers_own_figures(tmp_path, server, capsys):
    from rltune.profile.adapters.vllm import delta, parse_prometheus
    from rltune.profile.stage_map import map_metrics

    path = write_job(tmp_path, CLIENT, launch={"command": [sys.executable, "job.py", "--url", server, "--run-dir",
                                                           "{run_dir}", "--steps", "{steps}"], "timeout_s": 120})
    out = tmp_path / "run"
    assert main(["profile", str(path), "--steps", "3", "--out", str(out), "--vllm-metrics", f"{server}/metrics"]) == 0
    assert load_job(out / "job.yaml").metrics.vllm_metrics_url == f"{server}/metrics"
    rows = read_stages(out / "stages.parquet").to_pylist()
    assert [r["step"] for r in rows] == [0, 1, 2]
    previous = parse_prometheus((out / "direct-start.prom").read_text())
    for row in rows:
        now = parse_prometheus((out / f"direct-{row['step']}.prom").read_text())
        step = delta(previous, now)
        expected, _ = map_metrics("vllm", step)
        previous = now
        client = json.loads((out / f"client-{row['step']}.json").read_text())
        # what the client counted itself: the server's figures are about exactly its requests
        assert step["vllm:e2e_request_latency_seconds/count"] == client["requests"] == REQUESTS_PER_STEP
        assert expected["gen_tokens"] == client["tokens"] == sum(8 + i for i in range(REQUESTS_PER_STEP))
        assert expected["engine_decode_s"] > 0 and expected["engine_prefill_s"] > 0
        filled = {c: row[c] for c in expected}
        assert filled == pytest.approx(expected, rel=1e-12, abs=0), row["step"]
        assert row["vllm:e2e_request_latency_seconds/count"] == REQUESTS_PER_STEP  # extras keep vLLM's own names


def test_vllm_metrics_must_be_a_url_and_needs_a_job_to_run(tmp_path, capsys):
    path = write_job(tmp_path, "print('never runs')\n")
    assert main(["profile", str(path), "--vllm-metrics", "127.0.0.1:8000/metrics"]) == 2
    assert "--vllm-metrics '127.0.0.1:8000/metrics': expected an http(s) URL" in capsys.readouterr().err
    assert main(["profile", "--from-logs", str(path), "--vllm-metrics", "http://127.0.0.1:8000/metrics"]) == 2
    assert "--vllm-metrics scrapes a live engine" in capsys.readouterr().err
