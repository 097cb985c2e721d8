"""The orchestrator: one GRPO job from config to metrics.jsonl, in any of the three RL modes.

- ``sync``: generate batch k with weights v_k, (old-logprob pass), train, sync v_k+1. Nothing
  overlaps: step = rollout + training + weight sync.
- ``one_step_async``: batch k+1 is generated (with v_k) while the trainer trains on batch k; the
  sync of v_k+1 waits for both. Every batch after the first is one version old.
- ``fully_async``: groups are generated continuously; the trainer takes the first
  ``tasks_per_batch`` finished groups, and engines take new weights between decode steps, mid
  flight. Rollout of batch b may start only once the engines hold version >= b - max_sample_age;
  a group older than max_sample_age when trained is dropped (counted).

Sample age = the trainer's weight version when it trains a sample minus the oldest version that
generated any of the sample's tokens.
"""

from __future__ import annotations

import json
import math
import os
import queue
import threading
import time
from pathlib import Path
from typing import Any

from rltune.contracts.schema import dump_yaml
from rltune.errors import RltuneError
from rltune.workload.config import WorkloadConfig
from rltune.workload.heap import frozen_heap
from rltune.workload.rollout import EngineClient, Group, Rollout


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


class MetricsWriter:
    """Appends one JSON object per step to metrics.jsonl, flushed, so a killed run keeps its steps."""

    def __init__(self, path: Path):
        self.path = path
        self.handle = open(path, "w", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        clean = {k: v for k, v in record.items() if v is not None and not (isinstance(v, float) and math.isnan(v))}
        self.handle.write(json.dumps(clean, sort_keys=False) + "\n")
        self.handle.flush()

    def close(self) -> None:
        self.handle.close()


def batch_samples(groups: list[Group], normalize_std: bool):
    """GRPO samples of some groups: group-relative advantages; trials with no tokens carry no loss."""
    import torch

    from rltune.workload.grpo import group_advantages
    from rltune.workload.trainer import TrainSample

    samples = []
    for group in groups:
        rewards = torch.tensor([t.reward for t in group.trajectories], dtype=torch.float64)
        advantages = group_advantages(rewards, normalize_std).tolist()
        for traj, adv in zip(group.trajectories, advantages, strict=True):
            if traj.gen_tokens == 0:
                continue
            samples.append(TrainSample(traj.tokens, traj.loss_mask, traj.rollout_logprobs, float(adv), traj.version))
    return samples


class _Job:
    def __init__(self, cfg: WorkloadConfig, run_dir: Path, trainer):
        from rltune.workload.engine import EngineSettings
        from rltune.workload.model import resolve_device

        self.cfg = cfg
        self.run_dir = run_dir
        self.trainer = trainer
        self.publisher = make_workload_publisher(cfg, run_dir, trainer)
        if self.publisher.drives_optimizer_step:
            trainer.trainer.optimizer_step = self.publisher.optimizer_step
        if cfg.engine.backend == "vllm":
            from rltune.workload import engine_vllm
            from rltune.workload.model import torch_dtype

            boot = engine_vllm.write_boot_checkpoint(trainer.module, run_dir / "engine-boot",
                                                     torch_dtype(cfg.model.engine_dtype))
            settings = engine_vllm.settings_for(cfg, run_dir, boot, self.publisher.loader("vllm"))
        else:
            settings = EngineSettings(
                preset=cfg.model.preset, seed=cfg.model.seed, dtype=cfg.model.engine_dtype,
                device=resolve_device(cfg.engine.device), attn_implementation=cfg.model.attn_implementation,
                max_concurrent_seqs=cfg.engine.max_concurrent_seqs, batching=cfg.engine.batching,
                kv_cache_tokens=cfg.engine.kv_cache_tokens, compile=cfg.engine.compile,
                num_threads=cfg.engine.num_threads, sample_seed=cfg.orchestrator.seed,
                loader=self.publisher.loader(),
                max_context_tokens=cfg.env.context_limit_tokens + cfg.env.max_new_tokens)
        from rltune.workload.placement import place, visible_gpus

        devices = place(cfg, visible_gpus(), settings.device, settings.device).engines
        self.client = EngineClient(settings, cfg.engine.num_engines, devices=devices)
        # vLLM engines: the step's engine columns are increments of vLLM's own counters since here
        self.engine_metrics = None
        if cfg.engine.backend == "vllm":
            self.engine_metrics = engine_vllm.VllmStepMetrics([s["vllm"] for s in self.client.stats()])
        self.rollout = Rollout(cfg, self.client, workdir=None)
        self.writer = MetricsWriter(run_dir / "metrics.jsonl")
        self.engine_version = 0
        self.last_step_end = time.monotonic()
        self.extra_first: dict[str, float] = {"engine_startup_s": self.client.startup_s}

    # -- pieces -----------------------------------------------------------------------------------
    def start_batch(self) -> list:
        return [self.rollout.start_group(self.rollout.next_task()) for _ in range(self.cfg.orchestrator.tasks_per_batch)]

    def sync_weights(self) -> dict[str, float]:
        start = time.perf_counter()
        version = self.trainer.version
        published = self.publisher.publish(version)
        loads = self.client.load_weights(version, published.message)
        self.publisher.loaded(version)
        self.engine_version = version
        out = {"weight_sync_s": time.perf_counter() - start, "sync_publish_s": published.seconds,
               "sync_bytes": float(published.bytes), "sync_load_s_max": max(x["load_s"] for x in loads)}
        for key in ("delta_bytes", "anchor_bytes"):
            if key in published.details:
                out[f"sync_{key}"] = published.details[key]
        if all("changes_applied" in x for x in loads):  # sparse deltas: elements each engine patched
            out["sync_changes"] = max(x["changes_applied"] for x in loads)
        # dispatch stopped for the update; reading + decoding (in the pause, or while serving when the loader
        # prefetched); patching the weights; waiting on the prefetch before the pause
        for key in ("blocking_s", "read_s", "write_s", "prefetch_s"):
            if all(key in x for x in loads):
                out[f"sync_{key}_max"] = max(x[key] for x in loads)
        if all("prefetched" in x for x in loads):
            out["sync_prefetched_frac"] = sum(x["prefetched"] for x in loads) / len(loads)
        return out

    def train(self, groups: list[Group]) -> tuple[dict[str, float], list[int]]:
        version_before = self.trainer.version
        samples = batch_samples(groups, self.cfg.trainer.normalize_adv_std)
        ages = [version_before - t.version for g in groups for t in g.trajectories if t.version is not None]
        if not samples:
            raise RltuneError("a whole batch produced no generated tokens (every trial cut off or failed); "
                              "raise env.trial_timeout_s or check the sandbox limits")
        result = self.trainer.step(samples, separate_old_pass=not self.cfg.trainer.reuse_rollout_logprobs)
        return result, ages

    def record(self, step: int, groups: list[Group], rollout_s: float, wait_s: float,
               train: dict[str, float], ages: list[int], sync: dict[str, float], extra: dict[str, Any]) -> None:
        now = time.monotonic()
        trajs = [t for g in groups for t in g.trajectories]
        engine_stats = self.client.stats()
        gen_tokens = sum(t.gen_tokens for t in trajs)
        tool_use = self.cfg.env.kind == "tool_use"
        engine = self.engine_columns(engine_stats, trajs)
        rec: dict[str, Any] = {
            "step": step,
            "step_s": now - self.last_step_end,
            "rollout_s": rollout_s,
            "training_s": train["train_elapsed_s"],
            "weight_sync_s": sync["weight_sync_s"],
            "old_logprob_s": train["old_logprob_s"],
            "wait_s": wait_s,
            "engine_queue_s": engine["engine_queue_s"],
            "engine_prefill_s": engine["engine_prefill_s"],
            "engine_decode_s": engine["engine_decode_s"],
            "engine_preemptions": engine["engine_preemptions"],
            "kv_cache_usage": engine["kv_cache_usage"],
            "gen_tokens": float(gen_tokens),
            "sandbox_setup_s": _mean([t.setup_s for t in trajs if t.setup_s is not None]) if tool_use else None,
            "sandbox_exec_s": _mean([t.exec_s for t in trajs if t.exec_s is not None]) if tool_use else None,
            "trainer_busy_frac": train["compute_s"] / train["train_elapsed_s"] if train["train_elapsed_s"] > 0 else None,
            "padding_frac": 1.0 - train["real_tokens"] / train["total_tokens"] if train["total_tokens"] else None,
            "gap": train["gap_sum"] / train["gap_n"] if train["gap_n"] else None,
            "sample_age_mean": _mean([float(a) for a in ages]),
            "sample_age_max": float(max(ages)) if ages else None,
            "trials_total": float(len(trajs)),
            "trials_cut_off": float(sum(t.cut_off for t in trajs)),
            "trials_failed": float(sum(t.failed for t in trajs)),
            "reward": _mean([t.reward for t in trajs]),
            # extras
            "weight_version": float(self.trainer.version),
            "tokens_per_s": gen_tokens / rollout_s if rollout_s > 0 else None,
            "sync_bytes": sync["sync_bytes"],
            "sync_publish_s": sync["sync_publish_s"],
            "sync_load_s_max": sync["sync_load_s_max"],
            "loss": train["loss"],
            "clip_frac": train["clip_frac"],
            "micro_batches": train["micro_batches"],
            "engine_busy_s": engine.get("engine_busy_s"),
            "engine_decode_steps": engine.get("engine_decode_steps"),
            "engine_gen_tokens": engine.get("engine_gen_tokens"),
            "turns_mean": _mean([float(t.turns) for t in trajs]),
        }
        rec.update({k: v for k, v in engine.items() if k not in rec})
        if tool_use:
            rec["sandbox_kills"] = float(sum(t.sandbox_kills for t in trajs))
            # Each sandbox host's load, queue wait and file-system time (what sandbox_hosts_overloaded reads),
            # and the slowest and typical trial (what long_tail_trials reads).
            rec.update(self.rollout.sandbox_columns(trajs))
            seconds = sorted(t.seconds for t in trajs)
            if seconds:
                rec["trial_s_max"] = seconds[-1]
                rec["trial_s_median"] = seconds[len(seconds) // 2] if len(seconds) % 2 else \
                    (seconds[len(seconds) // 2 - 1] + seconds[len(seconds) // 2]) / 2
        rec.update({k: v for k, v in sync.items() if k not in rec and k != "weight_sync_s"})
        rec.update(extra)
        if step == 0:
            rec.update(self.extra_first)
        self.writer.write(rec)
        self.last_step_end = now

    def engine_columns(self, engine_stats: list[dict], trajs: list) -> dict[str, Any]:
        """The step's engine columns: vLLM's own counters (vLLM engines), else the HF engines' and the trials' figures."""
        if self.engine_metrics is not None:
            return self.engine_metrics.columns(engine_stats)
        return {
            "engine_queue_s": _mean([x for t in trajs for x in t.queue_s]),
            "engine_prefill_s": _mean([x for t in trajs for x in t.prefill_s]),
            "engine_decode_s": _mean([x for t in trajs for x in t.decode_s]),
            "engine_preemptions": float(sum(s["preemptions"] for s in engine_stats)),
            "kv_cache_usage": max(s["kv_peak_frac"] for s in engine_stats),
            "engine_busy_s": sum(s["busy_s"] for s in engine_stats),
            "engine_decode_steps": float(sum(s["forward_steps"] for s in engine_stats)),
            "engine_gen_tokens": float(sum(s["gen_tokens"] for s in engine_stats)),
        }

    @staticmethod
    def wait_groups(futures: list) -> tuple[list[Group], float]:
        """Wait for a batch of group futures; (groups, rollout wall time from first start to last finish)."""
        groups = [f.result() for f in futures]
        return groups, max(g.finished for g in groups) - min(g.started for g in groups)

    # -- RL modes ---------------------------------------------------------------------------------
    def run_sync(self, steps: int) -> None:
        for step in range(steps):
            t0 = time.monotonic()
            groups, rollout_s = self.wait_groups(self.start_batch())
            wait_s = time.monotonic() - t0
            train, ages = self.train(groups)
            sync = self.sync_weights()
            self.record(step, groups, rollout_s, wait_s, train, ages, sync, {})

    def run_one_step_async(self, steps: int) -> None:
        pending = self.start_batch()
        for step in range(steps):
            t0 = time.monotonic()
            groups, rollout_s = self.wait_groups(pending)
            wait_s = time.monotonic() - t0
            # The next batch is generated with the engines' current weights while we train.
            pending = self.start_batch()
            train, ages = self.train(groups)
            t1 = time.monotonic()
            for f in pending:
                f.result()
            wait_s += time.monotonic() - t1
            sync = self.sync_weights()
            self.record(step, groups, rollout_s, wait_s, train, ages, sync, {})

    def run_fully_async(self, steps: int) -> None:
        cfg = self.cfg.orchestrator
        finished: queue.Queue = queue.Queue()
        cond = threading.Condition()
        stop = threading.Event()
        state = {"started": 0, "error": None}

        def produce() -> None:
            try:
                while not stop.is_set():
                    batch_index = state["started"] // cfg.tasks_per_batch
                    with cond:
                        # Rollout runs at most max_sample_age versions ahead of the engines' weights.
                        while not stop.is_set() and self.engine_version < batch_index - cfg.max_sample_age:
                            cond.wait(timeout=0.5)
                    if stop.is_set():
                        return
                    future = self.rollout.start_group(self.rollout.next_task())
                    future.add_done_callback(finished.put)
                    state["started"] += 1
            except RltuneError as exc:
                state["error"] = exc

        producer = threading.Thread(target=produce, name="rltune-producer", daemon=True)
        producer.start()
        dropped = 0
        try:
            for step in range(steps):
                t0 = time.monotonic()
                groups: list[Group] = []
                while len(groups) < cfg.tasks_per_batch:
                    try:
                        future = finished.get(timeout=1.0)
                    except queue.Empty:
                        if state["error"] is not None:
                            raise state["error"] from None
                        continue
                    group = future.result()
                    if self.trainer.version - group.version > cfg.max_sample_age:
                        dropped += 1
                        continue
                    groups.append(group)
                wait_s = time.monotonic() - t0
                rollout_s = max(g.finished for g in groups) - min(g.started for g in groups)
                train, ages = self.train(groups)
                sync = self.sync_weights()
                with cond:
                    cond.notify_all()
                self.record(step, groups, rollout_s, wait_s, train, ages, sync, {"groups_dropped_stale": float(dropped)})
        finally:
            stop.set()
            with cond:
                cond.notify_all()
            producer.join(timeout=30)

    def close(self) -> None:
        self.client.abort_pending()
        self.rollout.close()
        self.client.close()
        self.publisher.close()
        self.writer.close()


def make_workload_publisher(cfg: WorkloadConfig, run_dir: Path, trainer):
    """The trainer side of ``sync.transport``, from rltune.sync's one transport layer."""
    from rltune.sync.sender import DeltaPublisherConfig
    from rltune.sync.transports import make_publisher
    from rltune.workload.model import torch_dtype

    module = trainer.module
    engine_dtype = torch_dtype(cfg.model.engine_dtype)
    wire = engine_dtype if engine_dtype != next(module.parameters()).dtype else None
    publisher = make_publisher(cfg.sync.transport, model=module, workdir=run_dir, optimizer=trainer.optimizer,
                               engine_dtype=engine_dtype, keep=cfg.sync.keep_checkpoints, shared=True,
                               delta=DeltaPublisherConfig(interval=cfg.sync.anchor_interval, run_id="workload",
                                                          wire_dtype=wire, coding=cfg.sync.delta_coding))
    if publisher.drives_optimizer_step:
        publisher.publish(0)  # the weights the engines start with: the base of the first delta
    return publisher


def run_job(cfg: WorkloadConfig, run_dir: str | os.PathLike, steps: int | None = None, trainer=None) -> Path:
    """Run the job; write ``config.yaml`` (resolved) and ``metrics.jsonl`` into ``run_dir``; return the latter."""
    from rltune.workload.trainer import DistributedTrainer, GRPOTrainer

    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    if steps is not None:
        cfg.orchestrator.steps = steps
    dump_yaml(cfg, run_dir / "config.yaml")
    if trainer is None:
        trainer = DistributedTrainer(GRPOTrainer(cfg))
    job = _Job(cfg, run_dir, trainer)
    try:
        mode = cfg.orchestrator.rl_mode
        runner = {"sync": job.run_sync, "one_step_async": job.run_one_step_async,
                  "fully_async": job.run_fully_async}[mode]
        with frozen_heap():  # what start-up built stays out of the collector's walks while the steps run
            runner(cfg.orchestrator.steps)
    finally:
        job.close()
        trainer.stop()
    return run_dir / "metrics.jsonl"
