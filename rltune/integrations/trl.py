"""A ``TrainerCallback`` that puts TRL GRPO's stage timers and the samples' age into its logged metrics.

TRL times the parts of a GRPO step with its profiling context (``profiling/Time taken:
GRPOTrainer.<part>``) but sends the times only to trackers (wandb, mlflow, trackio), never to the
console or ``trainer_state.json``. :class:`TrlStageTimers` listens to that context while a step
runs and, at the end of every optimizer step, adds to the trainer's metrics (the ones TRL averages
into each log line):

- each TRL timer that fired in the step, under TRL's own name, summed over the step's micro-steps;
- the stage times rltune derives from them, under ``rltune/`` (seconds, per optimizer step):

  ============================  ==============================================================
  ``rltune/step_s``             wall time since the previous step ended (the first: since
                                training began): data, micro-steps, optimizer, logging
  ``rltune/rollout_s``          ``_prepare_inputs`` less the log-prob passes and weight sync in
                                it: generation, reward scoring and building the batch; micro-
                                seconds on a step that only hands out buffered samples
  ``rltune/generate_s``         the generation timers (``transformers.generate``,
                                ``transformers.generate_batch``, ``vLLM.generate``)
  ``rltune/reward_s``           ``_calculate_rewards``
  ``rltune/old_logprob_s``      ``_get_per_token_logps_and_entropies`` inside ``_prepare_inputs``:
                                the old- and reference-policy log-prob passes
  ``rltune/weight_sync_s``      ``sync_weights`` (vLLM only; 0 without vLLM, where the generating
                                model *is* the trained one and nothing is synced)
  ``rltune/training_s``         the step from its first micro-step to its end, less
                                ``_prepare_inputs``: forward, backward, clipping, optimizer
  ``rltune/forward_s``          ``compute_loss`` (TRL's timer covers the forward pass only)
  ``rltune/optimizer_s``        ``optimizer.step()``
  ``rltune/generations``        generation rounds in the step
  ``rltune/sample_age_mean``    mean age of the step's samples in weight versions (optimizer
  ``rltune/sample_age_max``     steps between the weights that generated a sample and the
                                weights it trains), over its micro-steps; see below
  ============================  ==============================================================

Sample age is exact, not estimated: a generation round stamps its buffer with the trainer's
``global_step`` at that moment (the weights that generated it: TRL generates with the live model,
or syncs vLLM to it just before), and each ``compute_loss`` trains one micro-batch of the newest
buffer at the current ``global_step``. Every micro-batch holds ``per_device_train_batch_size``
samples, so the mean over micro-steps is the mean over samples.

Use ``attach(trainer)`` after building a ``GRPOTrainer`` (or ``trainer.add_callback(
TrlStageTimers(trainer))``). With ``logging_steps: 1`` every log line is one step; with more, TRL
averages the values over the steps of a line, as it does its own metrics. The callback also keeps
``<output_dir>/trainer_state.json`` current at every log (TRL writes it only at checkpoints), so
the log history survives a crash.
"""

from __future__ import annotations

import os
import time
from collections import defaultdict
from typing import Any

from transformers import TrainerCallback

PROFILING_PREFIX = "profiling/Time taken: "
# Parts of TRL 1.x's GRPOTrainer (the profiling name without its 'ClassName.' prefix).
PREPARE_PART = "_prepare_inputs"
GENERATE_PARTS = ("transformers.generate", "transformers.generate_batch", "vLLM.generate")
REWARD_PART = "_calculate_rewards"
LOGPROB_PART = "_get_per_token_logps_and_entropies"
FORWARD_PART = "compute_loss"
SYNC_PART = "sync_weights"

STEP_S = "rltune/step_s"
ROLLOUT_S = "rltune/rollout_s"
GENERATE_S = "rltune/generate_s"
REWARD_S = "rltune/reward_s"
OLD_LOGPROB_S = "rltune/old_logprob_s"
WEIGHT_SYNC_S = "rltune/weight_sync_s"
TRAINING_S = "rltune/training_s"
FORWARD_S = "rltune/forward_s"
OPTIMIZER_S = "rltune/optimizer_s"
GENERATIONS = "rltune/generations"
SAMPLE_AGE_MEAN = "rltune/sample_age_mean"
SAMPLE_AGE_MAX = "rltune/sample_age_max"
KEYS = (STEP_S, ROLLOUT_S, GENERATE_S, REWARD_S, OLD_LOGPROB_S, WEIGHT_SYNC_S, TRAINING_S, FORWARD_S, OPTIMIZER_S,
        GENERATIONS, SAMPLE_AGE_MEAN, SAMPLE_AGE_MAX)
STATE_FILE = "trainer_state.json"


def part_of(name: str) -> str:
    """'GRPOTrainer.vLLM.generate' -> 'vLLM.generate' (the profiling name without its class)."""
    return name.split(".", 1)[1] if "." in name else name


class _StepRecord:
    """The timers of one optimizer step, as they closed: (name, seconds, names of the enclosing timers)."""

    def __init__(self) -> None:
        self.timers: list[tuple[str, float, tuple[str, ...]]] = []
        self.ages: list[int] = []

    def total(self, parts: tuple[str, ...], inside: str | None = None) -> float:
        return sum(seconds for name, seconds, parents in self.timers if part_of(name) in parts
                   and (inside is None or any(part_of(p) == inside for p in parents)))

    def count(self, part: str) -> int:
        return sum(1 for name, _, _ in self.timers if part_of(name) == part)

    def by_name(self) -> dict[str, float]:
        out: dict[str, float] = defaultdict(float)
        for name, seconds, _ in self.timers:
            out[PROFILING_PREFIX + name] += seconds
        return dict(out)


# -- listening to TRL's profiling context ---------------------------------------------------------
# TRL builds a fresh ProfilingContext for every timed block; wrapping the class's __enter__/__exit__
# (once per process, while some callback listens) sees every one of them, whatever it reports to.
_LISTENERS: list[TrlStageTimers] = []
_ORIGINAL: dict[str, Any] = {}


def _install(listener: TrlStageTimers) -> None:
    from trl.extras.profiling import ProfilingContext

    if listener not in _LISTENERS:
        _LISTENERS.append(listener)
    if _ORIGINAL:
        return
    _ORIGINAL["enter"], _ORIGINAL["exit"] = ProfilingContext.__enter__, ProfilingContext.__exit__

    def enter(ctx: Any) -> Any:
        for active in _LISTENERS:
            active._timer_opened(ctx.name)
        return _ORIGINAL["enter"](ctx)

    def exit_(ctx: Any, *exc: Any) -> Any:
        result = _ORIGINAL["exit"](ctx, *exc)
        for active in _LISTENERS:
            active._timer_closed(ctx.name)
        return result

    ProfilingContext.__enter__, ProfilingContext.__exit__ = enter, exit_


def _uninstall(listener: TrlStageTimers) -> None:
    from trl.extras.profiling import ProfilingContext

    if listener in _LISTENERS:
        _LISTENERS.remove(listener)
    if not _LISTENERS and _ORIGINAL:
        ProfilingContext.__enter__, ProfilingContext.__exit__ = _ORIGINAL.pop("enter"), _ORIGINAL.pop("exit")


class TrlStageTimers(TrainerCallback):
    """Adds TRL's stage timers, rltune's stage times and sample age to every step's logged metrics."""

    def __init__(self, trainer: Any, write_state: bool = True):
        metrics = getattr(trainer, "_metrics", None)
        if not isinstance(metrics, dict) or "train" not in metrics:
            raise TypeError(f"{type(trainer).__name__} has no per-mode '_metrics' to log into; "
                            "TrlStageTimers needs a TRL GRPOTrainer (trl >= 0.14)")
        self.trainer = trainer
        self.write_state = write_state
        self._state: Any = None
        self._stack: list[tuple[str, float]] = []
        self._step: _StepRecord | None = None
        self._buffer_version: int | None = None
        self._last_end = 0.0
        self._begin = self._pre_optimizer = self._post_optimizer = 0.0

    # -- the profiling context ---------------------------------------------------------------
    def _timer_opened(self, name: str) -> None:
        self._stack.append((name, time.perf_counter()))

    def _timer_closed(self, name: str) -> None:
        now = time.perf_counter()
        # Blocks close in reverse order of opening; search from the top in case one never closed.
        for i in range(len(self._stack) - 1, -1, -1):
            if self._stack[i][0] == name:
                _, opened = self._stack.pop(i)
                parents = tuple(n for n, _ in self._stack[:i])
                break
        else:
            return
        if self._step is None:  # evaluation or anything else outside an optimizer step
            return
        self._step.timers.append((name, now - opened, parents))
        part = part_of(name)
        if part in GENERATE_PARTS or part == REWARD_PART:
            self._buffer_version = self._state.global_step
        elif part == FORWARD_PART and self._buffer_version is not None:
            self._step.ages.append(self._state.global_step - self._buffer_version)

    # -- trainer events ----------------------------------------------------------------------
    def on_train_begin(self, args, state, control, **kwargs):
        self._state = state
        self._last_end = time.perf_counter()
        _install(self)

    def on_train_end(self, args, state, control, **kwargs):
        _uninstall(self)

    def on_step_begin(self, args, state, control, **kwargs):
        self._step = _StepRecord()
        self._begin = time.perf_counter()
        self._pre_optimizer = self._post_optimizer = 0.0

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self._pre_optimizer = time.perf_counter()

    def on_optimizer_step(self, args, state, control, **kwargs):
        self._post_optimizer = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        end = time.perf_counter()
        record, self._step = self._step, None
        if record is None:
            return
        values = self.step_values(record, end, use_vllm=bool(getattr(args, "use_vllm", False)))
        self._last_end = end
        metrics = self.trainer._metrics["train"]
        for key, value in values.items():
            metrics[key].append(value)

    def step_values(self, record: _StepRecord, end: float, use_vllm: bool) -> dict[str, float]:
        """The metrics one optimizer step adds (see the module docstring for each)."""
        prepare = record.total((PREPARE_PART,))
        old_logprob = record.total((LOGPROB_PART,), inside=PREPARE_PART)
        sync = record.total((SYNC_PART,))
        values = record.by_name()
        values.update({
            STEP_S: end - self._last_end,
            ROLLOUT_S: max(0.0, prepare - old_logprob - sync),
            GENERATE_S: record.total(GENERATE_PARTS),
            REWARD_S: record.total((REWARD_PART,)),
            OLD_LOGPROB_S: old_logprob,
            WEIGHT_SYNC_S: sync if use_vllm else 0.0,
            TRAINING_S: max(0.0, (end - self._begin) - prepare),
            FORWARD_S: record.total((FORWARD_PART,)),
            GENERATIONS: float(record.count(REWARD_PART)),
        })
        if self._post_optimizer >= self._pre_optimizer > 0:
            values[OPTIMIZER_S] = self._post_optimizer - self._pre_optimizer
        if record.ages:
            values[SAMPLE_AGE_MEAN] = sum(record.ages) / len(record.ages)
            values[SAMPLE_AGE_MAX] = float(max(record.ages))
        return values

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not self.write_state or not state.is_world_process_zero:
            return
        # Written whole and renamed, so a reader never sees half a file.
        path = os.path.join(args.output_dir, STATE_FILE)
        os.makedirs(args.output_dir, exist_ok=True)
        tmp = f"{path}.tmp{os.getpid()}"
        state.save_to_json(tmp)
        os.replace(tmp, path)


def attach(trainer: Any, write_state: bool = True) -> TrlStageTimers:
    """Add a :class:`TrlStageTimers` to ``trainer`` and return it."""
    callback = TrlStageTimers(trainer, write_state=write_state)
    trainer.add_callback(callback)
    return callback
