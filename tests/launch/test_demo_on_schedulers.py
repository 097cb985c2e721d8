"""The scheduler presets end to end: `rltune profile` of the CPU demo with its runs on the real SLURM cluster / Ray head."""

from __future__ import annotations

from pathlib import Path

import yaml

from rltune.profile.run import profile_job

REPO = Path(__file__).resolve().parents[2]


def _preset_copy(tmp_path: Path, name: str, **launch) -> Path:
    """The preset as it is, but for what only the test's scheduler knows (its address) and an absolute workdir."""
    data = yaml.safe_load((REPO / "presets" / name).read_text())
    data["launch"].update(workdir=str(REPO), **launch)
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def _check(result, launcher: str) -> None:
    assert result.launch.ok, result.launch.log_tail(30)
    assert result.launch.identity["launcher"] == launcher
    assert result.table.num_rows == 3 and result.diagnosis is not None
    assert (result.run_dir / "metrics.jsonl").exists() and (result.run_dir / "job.yaml").exists()


def test_the_cpu_demo_profiles_with_its_run_a_slurm_batch_job(slurm, tmp_path):
    result = profile_job(_preset_copy(tmp_path, "cpu-demo-slurm.yaml"), tmp_path / "run", steps=3)
    _check(result, "slurm")
    assert slurm.scontrol_job(result.launch.identity["job_id"])["NumCPUs"] == "2"


def test_the_cpu_demo_profiles_with_its_run_a_ray_job(ray_head, tmp_path):
    result = profile_job(_preset_copy(tmp_path, "cpu-demo-ray.yaml", ray_address=ray_head.address), tmp_path / "run",
                         steps=3)
    _check(result, "ray")
