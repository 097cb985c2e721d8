"""Real schedulers on this machine for the launcher tests: a one-node SLURM cluster and a Ray head.

Both listen on 127.0.0.1 only, on ports picked free at start, with all their state in a temporary
directory; each is started by a session fixture (conftest.py beside this file) and stopped by it, also
when a test fails. Every daemon carries RLTUNE_TEST_DAEMON=<its directory> in its environment, so
the stop finds whatever of it is left (slurmstepd, Ray workers) by that mark and nothing else.

SLURM (Debian's slurm-wlm 22.05 packages: slurmctld, slurmd, slurm-client, munge): munged with its
own key and socket; slurmctld and slurmd in the foreground, as root, from a slurm.conf written
here: one node 'localhost' with 2 CPUs, partition 'debug', proctrack/linuxproc and task/none (no
cgroups), select/cons_tres by CPU, no accounting (sacct answers 'Slurm accounting storage is
disabled'; see rltune.launch.slurm for how a finished job is read without it), KillWait 5 s and
SlurmdTimeout 5 s so that cancelling and a lost node show within seconds.

Ray (the ray[default] wheel): ``ray start --head --block`` with the dashboard (the jobs API) on
127.0.0.1, 2 CPUs, a 100 MB object store. RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 makes Ray take the
loopback address as the node's (otherwise it advertises the machine's network address even with
--node-ip-address 127.0.0.1), and usage stats are off.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MARK = "RLTUNE_TEST_DAEMON"
SLURM_PROGRAMS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "scancel", "sinfo")
SLURM_INSTALL = "apt-get install -y slurmctld slurmd slurm-client munge (make setup does this as root on Debian)"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_ports(n: int) -> list[int]:
    ports: set[int] = set()
    while len(ports) < n:
        ports.add(free_port())
    return sorted(ports)


def marked_pids(mark: str) -> list[int]:
    """Processes whose environment carries MARK=mark (the daemons of one fixture and what they forked)."""
    needle = f"{MARK}={mark}".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                pids.append(int(entry.name))
        except OSError:
            continue
    return pids


def descendants(pids: list[int]) -> list[int]:
    """``pids`` and every process below them in the process tree."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[-1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], list(pids)
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def kill_all(pids: list[int], sig: int = signal.SIGKILL) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie does not count)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0]
    except OSError:
        return False
    return state != "Z"


def wait_until(predicate, timeout_s: float, what: str, interval_s: float = 0.2):
    end = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > end:
            raise TimeoutError(f"{what}: not within {timeout_s:g} s")
        time.sleep(interval_s)


def _stop(proc: subprocess.Popen | None, grace_s: float = 10.0) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


# -- SLURM -------------------------------------------------------------------------------------------
def slurm_missing() -> str | None:
    """Why no SLURM cluster can be started here, or None if one can."""
    missing = [p for p in SLURM_PROGRAMS if shutil.which(p) is None and not Path(f"/usr/sbin/{p}").exists()]
    if missing:
        return f"{', '.join(missing)} not installed; {SLURM_INSTALL}"
    if os.geteuid() != 0:
        return "slurmd runs jobs only as root here (SlurmdUser=root); run the tests as root"
    return None


def slurm_installable() -> bool:
    """True where `make setup` would have installed SLURM (root on Debian): missing programs are a failure there."""
    return os.geteuid() == 0 and shutil.which("apt-get") is not None and Path("/etc/debian_version").exists()


def _program(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


class SlurmCluster:
    """A one-node SLURM cluster in ``root`` (start() / stop())."""

    def __init__(self, root: Path):
        self.root = root
        self.conf = root / "slurm.conf"
        self.munge_socket = root / "munge" / "munge.sock"
        self.ctld_port, self.slurmd_port = free_ports(2)
        self.cluster = "rltunetest"
        self.munged: subprocess.Popen | None = None
        self.slurmctld: subprocess.Popen | None = None
        self.slurmd: subprocess.Popen | None = None
        self.timings: dict[str, float] = {}

    @property
    def address(self) -> str:
        return f"localhost:{self.ctld_port}"

    def env(self, **extra: str) -> dict[str, str]:
        """The environment a slurm client command (or rltune) needs to talk to this cluster."""
        return {**os.environ, "SLURM_CONF": str(self.conf), **extra}

    def _daemon_env(self) -> dict[str, str]:
        return self.env(**{MARK: str(self.root)})

    def write_conf(self, path: Path | None = None, ctld_port: int | None = None) -> Path:
        path = path or self.conf
        r = self.root
        path.write_text("\n".join([
            f"ClusterName={self.cluster}",
            "SlurmctldHost=localhost(127.0.0.1)",
            f"SlurmctldPort={ctld_port or self.ctld_port}",
            f"SlurmdPort={self.slurmd_port}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            f"AuthInfo=socket={self.munge_socket}",
            "CredType=cred/munge",
            f"StateSaveLocation={r / 'state'}",
            f"SlurmdSpoolDir={r / 'spool'}",
            f"SlurmctldPidFile={r / 'slurmctld.pid'}",
            f"SlurmdPidFile={r / 'slurmd.pid'}",
            f"SlurmctldLogFile={r / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={r / 'log' / 'slurmd.log'}",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            "MpiDefault=none",
            "ReturnToService=2",
            "SlurmdTimeout=5",
            "KillWait=5",
            "InactiveLimit=0",
            "NodeName=localhost NodeAddr=127.0.0.1 CPUs=2 RealMemory=1000 State=UNKNOWN",
            "PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP",
            "",
        ]))
        return path

    def start(self) -> SlurmCluster:
        t0 = time.monotonic()
        for sub in ("state", "spool", "log", "munge"):
            (self.root / sub).mkdir(mode=0o700, parents=True, exist_ok=True)
        key = self.root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        self.write_conf()
        env = self._daemon_env()
        m = self.root / "munge"
        self.munged = subprocess.Popen(
            [_program("munged"), "--foreground", "--force", f"--socket={self.munge_socket}", f"--key-file={key}",
             f"--log-file={m / 'munged.log'}", f"--pid-file={m / 'munged.pid'}", f"--seed-file={m / 'munged.seed'}"],
            env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True)
        wait_until(self.munge_socket.exists, 20, f"munged socket {self.munge_socket}")
        self.slurmctld = self._start_daemon([_program("slurmctld"), "-D", "-i", "-f", str(self.conf)], "slurmctld")
        self.start_slurmd()
        self.timings["start_s"] = time.monotonic() - t0
        return self

    def _start_daemon(self, argv: list[str], name: str) -> subprocess.Popen:
        out = open(self.root / "log" / f"{name}.out", "ab")
        try:
            return subprocess.Popen(argv, env=self._daemon_env(), stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        finally:
            out.close()

    def start_slurmd(self) -> None:
        self.slurmd = self._start_daemon([_program("slurmd"), "-D", "-N", "localhost", "-f", str(self.conf)], "slurmd")
        wait_until(lambda: self.node_state() in ("idle", "mixed", "allocated"), 60,
                   f"slurm node 'localhost' up (log {self.root / 'log'})", 0.2)

    def restart_controller(self, clear_state: bool = False) -> None:
        """Stop slurmctld and start it again (``clear_state``: forget every job, as a controller reset does)."""
        _stop(self.slurmctld)
        argv = [_program("slurmctld"), "-D", "-i", "-f", str(self.conf)] + (["-c"] if clear_state else [])
        self.slurmctld = self._start_daemon(argv, "slurmctld")
        wait_until(lambda: self.node_state() in ("idle", "mixed", "allocated"), 60, "slurmctld back with its node")

    def kill_node(self) -> None:
        """What losing the node does: slurmd, every slurmstepd and every job process die at once."""
        keep = set(descendants([self.munged.pid, self.slurmctld.pid]))
        kill_all(descendants([pid for pid in marked_pids(str(self.root)) if pid not in keep]))
        if self.slurmd is not None:
            self.slurmd.wait(timeout=10)
        self.slurmd = None

    def node_state(self) -> str:
        out = subprocess.run(["sinfo", "-h", "-o", "%T"], env=self.env(), capture_output=True, text=True, timeout=60)
        return out.stdout.strip().rstrip("*~#$@+-")

    def scontrol_job(self, job_id: str) -> dict[str, str]:
        out = subprocess.run(["scontrol", "-o", "show", "job", job_id], env=self.env(), capture_output=True,
                             text=True, timeout=60)
        return dict(item.split("=", 1) for item in out.stdout.split() if "=" in item)

    def jobs_named(self, name: str) -> list[str]:
        out = subprocess.run(["squeue", "-h", "--states=all", f"--name={name}", "-o", "%i"], env=self.env(),
                             capture_output=True, text=True, timeout=60)
        return out.stdout.split()

    def stop(self) -> None:
        try:
            if self.slurmctld is not None and self.slurmctld.poll() is None:
                subprocess.run(["scancel", "--user=root"], env=self.env(), capture_output=True, timeout=30)
                try:
                    wait_until(lambda: not subprocess.run(
                        ["squeue", "-h", "-t", "R,CG,PD"], env=self.env(), capture_output=True, text=True,
                        timeout=30).stdout.strip(), 20, "jobs gone")
                except (TimeoutError, subprocess.TimeoutExpired):
                    pass
        finally:
            for proc in (self.slurmd, self.slurmctld, self.munged):
                _stop(proc)
            kill_all(descendants(marked_pids(str(self.root))))


# -- Ray ---------------------------------------------------------------------------------------------
def ray_missing() -> str | None:
    try:
        import ray  # noqa: F401
        from ray.job_submission import JobSubmissionClient  # noqa: F401
    except ImportError as exc:
        return f"ray is not installed ({exc}); pip install 'rltune[ray]' (make setup does)"
    if shutil.which("ray", path=str(Path(sys.executable).parent)) is None:
        return "the 'ray' command is not beside this Python; pip install 'rltune[ray]'"
    return None


class RayHead:
    """A one-node Ray cluster with its jobs API (start() / stop())."""

    def __init__(self):
        # Short: Ray puts unix sockets under it, and a socket path may not pass 107 bytes.
        self.root = Path(tempfile.mkdtemp(prefix="rlt-ray-", dir="/tmp"))
        (self.gcs, self.dashboard, self.agent_http, self.agent_grpc, self.client_server, self.metrics,
         self.runtime_env_agent, self.node_manager, self.object_manager, self.dashboard_metrics,
         self.autoscaler_metrics) = free_ports(11)
        self.min_worker_port = random.randrange(20000, 29000, 100)
        self.proc: subprocess.Popen | None = None
        self.timings: dict[str, float] = {}

    @property
    def address(self) -> str:
        return f"http://127.0.0.1:{self.dashboard}"

    def start(self) -> RayHead:
        t0 = time.monotonic()
        env = {**os.environ, MARK: str(self.root), "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
               "RAY_USAGE_STATS_ENABLED": "0", "DASHBOARD_METRIC_PORT": str(self.dashboard_metrics),
               "AUTOSCALER_METRIC_PORT": str(self.autoscaler_metrics)}
        argv = [str(Path(sys.executable).parent / "ray"), "start", "--head", "--block", "--disable-usage-stats",
                "--node-ip-address=127.0.0.1", f"--port={self.gcs}", "--include-dashboard=true",
                "--dashboard-host=127.0.0.1", f"--dashboard-port={self.dashboard}",
                f"--dashboard-agent-listen-port={self.agent_http}", f"--dashboard-agent-grpc-port={self.agent_grpc}",
                f"--ray-client-server-port={self.client_server}", f"--metrics-export-port={self.metrics}",
                f"--runtime-env-agent-port={self.runtime_env_agent}", f"--node-manager-port={self.node_manager}",
                f"--object-manager-port={self.object_manager}", f"--min-worker-port={self.min_worker_port}",
                f"--max-worker-port={self.min_worker_port + 99}", "--num-cpus=2", "--num-gpus=0",
                "--object-store-memory=100000000", f"--temp-dir={self.root}"]
        out = open(self.root / "start.log", "ab")
        try:
            self.proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        finally:
            out.close()
        from ray.job_submission import JobSubmissionClient

        def answers():
            if self.proc.poll() is not None:
                raise RuntimeError(f"ray start exited {self.proc.returncode}: "
                                   f"{(self.root / 'start.log').read_text()[-2000:]}")
            try:
                JobSubmissionClient(self.address).list_jobs()
                return True
            except Exception:  # noqa: BLE001 - not up yet, whatever the client raises
                return False

        wait_until(answers, 120, f"Ray jobs API at {self.address} (log {self.root / 'start.log'})", 0.5)
        self.timings["start_s"] = time.monotonic() - t0
        return self

    def stop(self) -> None:
        try:
            _stop(self.proc, grace_s=20)
        finally:
            kill_all(descendants(marked_pids(str(self.root))))
            shutil.rmtree(self.root, ignore_errors=True)
