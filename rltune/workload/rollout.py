"""Rollout: engine processes behind a client, and trials (math or multi-turn tool use) in threads.

A trial asks the engines for one model turn at a time; tool-use turns run in the trial's sandbox
on one of the sandbox hosts (:mod:`rltune.workload.sandbox_hosts`) and their output becomes the
next observation; after each executed turn the environment runs the task's test cases there
(``env.sandbox_test_cases``, a long-tailed number drawn per trial and turn). A group is one task's
``trials_per_task`` trials; GRPO needs the whole group, so a group finishes with its slowest trial
(or its time-out, counted from the trial's start: waiting for a sandbox and setting it up count).
"""

from __future__ import annotations

import itertools
import random
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from rltune.errors import RltuneError
from rltune.workload.config import WorkloadConfig
from rltune.workload.envs import Task, make_math_task, make_tool_task, partial_credit, tool_observation
from rltune.workload.sampling import request_key
from rltune.workload.sandbox import ImageSpec, SandboxLimits
from rltune.workload.tokenizer import TOKENIZER


class EngineError(RltuneError):
    """An engine process failed to start or crashed."""


class EngineClient:
    """Starts ``num_engines`` engine processes and routes requests to the least loaded one."""

    def __init__(self, settings, num_engines: int, start_timeout_s: float = 600.0, devices: list[str] | None = None):
        """``devices``: one per engine (the GPU split); default: every engine on ``settings.device``."""
        import dataclasses

        import torch.multiprocessing as mp

        from rltune.workload.engine import engine_main

        ctx = mp.get_context("spawn")
        self.out_queue = ctx.Queue()
        self.in_queues = [ctx.Queue() for _ in range(num_engines)]
        start = time.perf_counter()
        devices = devices or [settings.device] * num_engines
        self.devices = devices
        self.processes = [ctx.Process(target=engine_main, args=(i, dataclasses.replace(settings, device=devices[i]),
                                                                self.in_queues[i], self.out_queue),
                                      daemon=True, name=f"rltune-engine-{i}") for i in range(num_engines)]
        for proc in self.processes:
            proc.start()
        self._lock = threading.Lock()
        self._pending: dict[int, tuple[int, Future]] = {}
        self._outstanding = [0] * num_engines
        self._loads: dict[tuple[int, int], Future] = {}
        self._stats: dict[int, Future] = {}
        self._ids = itertools.count()
        self._error: str | None = None
        self._closing = False
        ready = 0
        while ready < num_engines:
            msg = self._wait_start(start + start_timeout_s)
            if msg[0] == "ready":
                ready += 1
            elif msg[0] == "error":
                self.close()
                raise EngineError(f"engine {msg[1]} failed to start:\n{msg[2]}")
        self.startup_s = time.perf_counter() - start
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._dispatch, name="rltune-engine-dispatch", daemon=True)
        self._thread.start()

    def _wait_start(self, deadline: float):
        """The next start-up message; an engine process that exits first, or the deadline, ends the wait."""
        import queue

        while True:
            try:
                return self.out_queue.get(timeout=0.5)
            except queue.Empty:
                pass
            dead = [p for p in self.processes if not p.is_alive()]
            if dead:
                try:  # what it sent before it exited (its error, with the traceback) comes first
                    return self.out_queue.get(timeout=0.5)
                except queue.Empty:
                    pass
            if dead or time.perf_counter() > deadline:
                self.close()
            if dead:
                codes = ", ".join(f"{p.name}: " + (f"killed by signal {-p.exitcode}" if p.exitcode < 0 else
                                                   f"exit code {p.exitcode}") for p in dead)
                raise EngineError(f"engine process exited before it was ready ({codes}); its error is on stderr. "
                                  "A script that starts a run without `if __name__ == \"__main__\":` ends this way "
                                  "(engines are spawned and import it again)") from None
            if time.perf_counter() > deadline:
                raise EngineError("engines did not start in time; see stderr") from None

    def _dispatch(self) -> None:
        import queue

        while not self._stop.is_set():
            try:
                msg = self.out_queue.get(timeout=0.5)
            except queue.Empty:
                dead = [p.name for p in self.processes if not p.is_alive()]
                if dead and not self._stop.is_set():
                    self._fail(f"engine process died: {', '.join(dead)}")
                    return
                continue
            kind = msg[0]
            with self._lock:
                if kind == "result":
                    entry = self._pending.pop(msg[2], None)  # None: cancelled, already uncounted
                    fut = None
                    if entry is not None:
                        self._outstanding[entry[0]] -= 1
                        fut = entry[1]
                elif kind == "loaded":
                    fut = self._loads.pop((msg[1], msg[2]), None)
                elif kind == "stats":
                    fut = self._stats.pop(msg[1], None)
                else:
                    fut = None
            if kind == "error":
                self._fail(f"engine {msg[1]} crashed:\n{msg[2]}")
                return
            if fut is not None:
                fut.set_result(msg[-1])

    def _fail(self, text: str) -> None:
        with self._lock:
            self._error = text
            futures = [f for _, f in self._pending.values()] + list(self._loads.values()) + list(self._stats.values())
            self._pending.clear()
            self._loads.clear()
            self._stats.clear()
        for fut in futures:
            if not fut.done():
                fut.set_exception(EngineError(text))

    def generate(self, prompt_ids: list[int], max_new_tokens: int, temperature: float,
                 sample_key: int) -> tuple[int, Future]:
        """Queue one request on the least loaded engine. ``sample_key`` names the request's random draws
        (see :func:`rltune.workload.sampling.request_key`): the same key, prompt and weights sample the same
        tokens whichever engine serves it, next to whichever other requests."""
        fut: Future = Future()
        with self._lock:
            if self._error:
                raise EngineError(self._error)
            if self._closing:
                raise EngineError("the run is shutting down; no new requests")
            req_id = next(self._ids)
            engine = min(range(len(self._outstanding)), key=self._outstanding.__getitem__)
            self._outstanding[engine] += 1
            self._pending[req_id] = (engine, fut)
        self.in_queues[engine].put(("generate", req_id, prompt_ids, max_new_tokens, temperature, time.monotonic(),
                                    sample_key))
        return req_id, fut

    def cancel(self, req_id: int) -> None:
        with self._lock:
            entry = self._pending.pop(req_id, None)
            if entry is None:
                return
            self._outstanding[entry[0]] -= 1
        self.in_queues[entry[0]].put(("cancel", req_id))

    def abort_pending(self) -> None:
        """At shutdown: fail every waiting request (the trials stop) and tell engines to drop them."""
        with self._lock:
            self._closing = True
            pending = list(self._pending.items())
            self._pending.clear()
        for req_id, (engine, fut) in pending:
            self.in_queues[engine].put(("cancel", req_id))
            if not fut.done():
                fut.set_exception(EngineError("the run is shutting down"))

    def load_weights(self, version: int, message: dict) -> list[dict]:
        """Every engine takes ``version``; blocks until all have loaded it."""
        futures = []
        with self._lock:
            for engine in range(len(self.in_queues)):
                fut: Future = Future()
                self._loads[(engine, version)] = fut
                futures.append(fut)
        for q in self.in_queues:
            q.put(("load", version, message))
        return [f.result(timeout=600) for f in futures]

    def stats(self) -> list[dict]:
        """Each engine's counters since the last call (and reset them)."""
        futures = []
        with self._lock:
            for engine in range(len(self.in_queues)):
                fut: Future = Future()
                self._stats[engine] = fut
                futures.append(fut)
        for q in self.in_queues:
            q.put(("stats",))
        return [f.result(timeout=600) for f in futures]

    def close(self) -> None:
        if hasattr(self, "_stop"):
            self._stop.set()
        for q in self.in_queues:
            q.put(("stop",))
        for proc in self.processes:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)


@dataclass
class Trajectory:
    """One trial: its token sequence (prompt, turns, observations) and what happened."""

    tokens: list[int]
    loss_mask: list[bool]
    rollout_logprobs: list[float]
    reward: float = 0.0
    version: int | None = None
    cut_off: bool = False
    failed: bool = False
    turns: int = 0
    gen_tokens: int = 0
    setup_s: float | None = None
    exec_s: float | None = None
    sandbox_kills: int = 0
    host: int | None = None
    queue_s_sandbox: float | None = None
    fs_s: float | None = None
    tests_run: int = 0
    seconds: float = 0.0
    queue_s: list[float] = field(default_factory=list)
    prefill_s: list[float] = field(default_factory=list)
    decode_s: list[float] = field(default_factory=list)
    preemptions: int = 0
    error: str | None = None


@dataclass
class Group:
    task: Task
    trajectories: list[Trajectory]
    started: float
    finished: float

    @property
    def version(self) -> int:
        versions = [t.version for t in self.trajectories if t.version is not None]
        return min(versions) if versions else -1


class Rollout:
    """Runs groups of trials against the engines (and sandboxes, for tool use)."""

    def __init__(self, cfg: WorkloadConfig, client: EngineClient, workdir: str | None = None):
        self.cfg = cfg
        self.env = cfg.env
        self.client = client
        self.task_rng = random.Random(cfg.env.seed)
        self._task_ids = itertools.count()
        workers = 2 * cfg.batch_size * (1 + cfg.orchestrator.max_sample_age) + 8
        self.executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="rltune-trial")
        self.hosts = None
        if self.env.kind == "tool_use":
            from rltune.workload.sandbox_hosts import SandboxHosts

            limits = SandboxLimits(self.env.sandbox_cpu_s, self.env.sandbox_memory_mb, self.env.sandbox_wall_s)
            self.hosts = SandboxHosts(self.env.sandbox_hosts, self.env.sandbox_pool_size, limits,
                                      ImageSpec(self.env.image_modules, self.env.prebuilt_image),
                                      cores_per_host=self.env.sandbox_host_cores,
                                      endpoints=self.env.sandbox_endpoints, workdir=workdir)

    def next_task(self) -> Task:
        task_id = f"t{next(self._task_ids)}"
        if self.env.kind == "math":
            return make_math_task(self.task_rng, task_id, self.env.max_operand, self.env.max_terms, self.env.operators)
        return make_tool_task(self.task_rng, task_id)

    def start_group(self, task: Task) -> Future:
        """Start the task's trials; the returned future gives the :class:`Group` when all are done."""
        started = time.monotonic()
        n = self.cfg.orchestrator.trials_per_task
        trial_futures = [self.executor.submit(self._trial, task, index) for index in range(n)]
        group_future: Future = Future()
        remaining = [n]
        lock = threading.Lock()

        def one_done(_):
            with lock:
                remaining[0] -= 1
                last = remaining[0] == 0
            if last:
                try:
                    trajectories = [f.result() for f in trial_futures]
                except BaseException as exc:  # an engine crash: hand it to whoever waits on the group
                    group_future.set_exception(exc)
                    return
                group_future.set_result(Group(task, trajectories, started, time.monotonic()))

        for f in trial_futures:
            f.add_done_callback(one_done)
        return group_future

    # -- trials -----------------------------------------------------------------------------------
    def _turn(self, traj: Trajectory, context: list[int], max_new: int, deadline: float, key: str) -> list[int] | None:
        """One model turn; None if the trial's time ran out first (the request is cancelled). ``key`` names
        the turn (task, trial, turn): its draws depend on it alone, not on when the request reached an engine."""
        req_id, fut = self.client.generate(list(context), max_new, self.env.temperature, request_key(key))
        try:
            result = fut.result(timeout=max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            self.client.cancel(req_id)
            if fut.done() and fut.exception() is None:
                result = fut.result()
            else:
                traj.cut_off = True
                return None
        traj.turns += 1
        traj.gen_tokens += len(result["tokens"])
        traj.queue_s.append(result["queue_s"])
        traj.prefill_s.append(result["prefill_s"])
        traj.decode_s.append(result["decode_s"])
        traj.preemptions += result["preemptions"]
        traj.version = result["version"] if traj.version is None else min(traj.version, result["version"])
        traj.tokens.extend(result["tokens"])
        traj.loss_mask.extend([True] * len(result["tokens"]))
        traj.rollout_logprobs.extend(result["logprobs"])
        return result["tokens"]

    def _trial(self, task: Task, index: int = 0) -> Trajectory:
        prompt = TOKENIZER.encode(task.prompt, bos=True)
        traj = Trajectory(list(prompt), [False] * len(prompt), [0.0] * len(prompt))
        started = time.monotonic()
        try:
            if self.env.kind == "math":
                deadline = started + self.env.trial_timeout_s
                tokens = self._turn(traj, traj.tokens, self.env.max_new_tokens, deadline, f"{task.task_id}:{index}:0")
                if tokens is not None:
                    traj.reward = partial_credit(TOKENIZER.decode(tokens), task.answer)
            else:
                self._tool_trial(task, traj, index, started + self.env.trial_timeout_s)
        except OSError as exc:  # sandbox setup failed (disk, fork) or its host died: the trial failed, the run goes on
            traj.failed = True
            traj.error = f"{type(exc).__name__}: {exc}"
            traj.host = getattr(exc, "host", traj.host)
            traj.reward = 0.0
        if traj.cut_off:
            traj.reward = 0.0
        traj.seconds = time.monotonic() - started
        return traj

    def test_cases(self, task: Task, index: int, turn: int) -> int:
        """Test cases the environment runs after turn ``turn`` of trial ``index`` of ``task``: the
        configured mean times a Pareto draw of mean 1 (shape ``sandbox_test_tail``), fixed by env.seed."""
        mean = self.env.sandbox_test_cases
        if mean <= 0:
            return 0
        alpha = self.env.sandbox_test_tail
        rng = random.Random(f"{self.env.seed}:{task.task_id}:{index}:{turn}")
        draw = (alpha - 1.0) / alpha * rng.paretovariate(alpha)  # scale x_m = (a - 1) / a: mean 1
        return max(1, min(int(round(mean * draw)), 100 * mean))

    def _tool_trial(self, task: Task, traj: Trajectory, index: int, deadline: float) -> None:
        with self.hosts.sandbox(task.files) as box:
            traj.setup_s, traj.host, traj.queue_s_sandbox = box.setup_s, box.host, box.queue_s
            try:
                final_text = self._turns(task, traj, index, deadline, box)
            finally:
                traj.exec_s = box.exec_s
        traj.fs_s = box.fs_s  # with the teardown's file-system time, known once the sandbox is closed
        if not traj.cut_off:
            traj.reward = partial_credit(final_text, task.answer)

    def _turns(self, task: Task, traj: Trajectory, index: int, deadline: float, box) -> str:
        """The trial's turns in its sandbox; the text of its last model turn."""
        final_text = ""
        if time.monotonic() > deadline:  # waiting for a sandbox and setting it up used the trial's time
            traj.cut_off = True
            return final_text
        for turn in range(self.env.max_turns):
            room = self.env.context_limit_tokens - len(traj.tokens)
            if room < 1:
                break
            tokens = self._turn(traj, traj.tokens, min(self.env.max_new_tokens, room), deadline,
                                f"{task.task_id}:{index}:{turn}")
            if tokens is None:
                break
            final_text = TOKENIZER.decode(tokens)
            if final_text.strip().startswith("answer") or turn == self.env.max_turns - 1:
                break
            tests = self.test_cases(task, index, turn)
            # The command may run only as long as the trial has left: past its time-out it is cut off.
            result = box.execute(final_text, tests=tests, wall_s=max(0.01, deadline - time.monotonic()))
            traj.tests_run += tests
            traj.sandbox_kills += int(result.killed)
            if time.monotonic() > deadline:
                traj.cut_off = True
                break
            observation = TOKENIZER.encode(tool_observation(result.output))
            if len(traj.tokens) + len(observation) >= self.env.context_limit_tokens:
                break
            traj.tokens.extend(observation)
            traj.loss_mask.extend([False] * len(observation))
            traj.rollout_logprobs.extend([0.0] * len(observation))
        return final_text

    def sandbox_columns(self, trajs: list[Trajectory]) -> dict[str, float]:
        """The step's sandbox-host columns (tool use): per trial means, each host's load and its trials' figures.

        ``sandbox_host_load`` is the busiest host's (its runnable commands per core while any ran);
        ``sandbox_queue_s`` and ``sandbox_fs_s`` are means per trial that got a sandbox;
        ``sandbox_host/<i>/...`` the same per host (a host that is gone keeps its trials and failed
        counts, and has no load).
        """
        from statistics import median

        placed = [t for t in trajs if t.host is not None]
        stats = self.hosts.host_stats()
        out: dict[str, float] = {"sandbox_hosts": float(self.hosts.live_count()),
                                 "sandbox_hosts_lost": float(self.hosts.lost)}
        if placed:
            out["sandbox_queue_s"] = sum(t.queue_s_sandbox or 0.0 for t in placed) / len(placed)
            out["sandbox_fs_s"] = sum(t.fs_s or 0.0 for t in placed) / len(placed)
            out["sandbox_tests_mean"] = sum(t.tests_run for t in placed) / len(placed)
        loads = [s["load"] for s in stats if s is not None and s["busy_frac"] > 0]
        if loads:
            out["sandbox_host_load"] = max(loads)
        for index, stat in enumerate(stats):
            prefix = f"sandbox_host/{index}/"
            if stat is not None:
                out[prefix + "load"] = float(stat["load"])
                out[prefix + "busy_frac"] = float(stat["busy_frac"])
            mine = [t for t in placed if t.host == index]
            out[prefix + "trials"] = float(len(mine))
            out[prefix + "failed"] = float(sum(t.failed for t in mine))
            if mine:
                out[prefix + "queue_s"] = sum(t.queue_s_sandbox or 0.0 for t in mine) / len(mine)
                out[prefix + "fs_s"] = sum(t.fs_s or 0.0 for t in mine) / len(mine)
                out[prefix + "setup_s"] = sum(t.setup_s or 0.0 for t in mine) / len(mine)
                out[prefix + "trial_s"] = median(t.seconds for t in mine)
        return out

    def close(self) -> None:
        self.executor.shutdown(wait=True, cancel_futures=True)
        if self.hosts is not None:
            self.hosts.close()
