"""SkyRL: the trainer's timer lines, its console tracker dict, and its progress bar.

SkyRL's trainer wraps each phase of a step in a ``Timer`` that logs (through loguru, often behind
Ray's ``(skyrl_entrypoint pid=N)`` prefix)::

    2026-03-26 15:05:44.938 | INFO     | skyrl.train.trainer:train:316 - Started: 'sync_weights'
    2026-03-26 15:05:51.979 | INFO     | skyrl.train.trainer:train:316 - Finished: 'sync_weights', time cost: 7.04s
    2026-03-26 15:05:51.980 | INFO     | skyrl.train.trainer:train:210 - Finished: 'step', time cost: 1331.13s
    Training Batches Processed:  14%|█▍        | 1/7 [22:36<2:15:37, 1356.23s/it]

Every ``Finished: '<name>'`` becomes ``timer/<name>`` (seconds) of the step it belongs to; a timer
that runs twice in a step (``generate`` under dynamic sampling) is summed. A step's timers are
those finished between ``Started: 'step'`` and ``Finished: 'step'``; a log that starts inside a
step gives that step the timers before its ``Finished: 'step'``. Timers that run between steps
(``eval`` after a step, ``save_checkpoints``) belong to the step before them, as SkyRL's own
tracker has them; those before the first step (initial weight sync, eval before training) belong
to no step and are counted in the report, as are the timer lines of a step the log ends inside.

Other lines read into the step: ``name: number, name: number`` info lines
(``avg_final_rewards: 0.13, avg_response_length: 273.68``; ``reward/avg_raw_reward: 0.21``) and
the ``{'policy_loss': ..., ...}`` dict printed after the step. With ``trainer.logger=console`` the
tracker also prints ``Step N:`` and the step's whole payload as a (possibly multi-line) dict with
values as quoted strings (``'timing/step': '286.0512'``): read as well, and it gives the step
number. Otherwise steps are numbered by the ``Training Batches Processed ... N/M`` bar after them,
or in order from 1 (the report says which).

Stage columns (rltune/profile/stage_map.py): ``step``; rollout = ``generate`` +
``postprocess_generator_output``; ``fwd_logprobs_values_reward`` is the separate forward pass
(old_logprob_s); training = ``train_critic_and_policy`` + ``compute_advantages_and_returns``;
weight sync = ``sync_weights``.

Real sample: tests/profiling/data/skyrl_gsm8k_timers_yottalabs_docs.log (yottalabsai/docs,
tutorials/page-1.md).
"""

from __future__ import annotations

import re

from rltune.profile.adapters._text import ParsedLog, clean_line, flatten, literal_dict, to_number
from rltune.profile.report import ParseReport

NAME = "skyrl"
# loguru's "<time> | LEVEL | module:function:line - message"; the message is what the patterns read.
_LOGURU = re.compile(r"^\s*\d{4}-\d\d-\d\d \d\d:\d\d:\d\d(?:\.\d+)? \| \w+\s*\| \S+ - (.*)$")
_FINISHED = re.compile(r"^Finished: '([^']+)', time cost: (\S+?)s\s*$")
_STARTED = re.compile(r"^Started: '([^']+)'\s*$")
_BAR = re.compile(r"Training Batches Processed:\s+\d+%\|[^|]*\|\s*(\d+)/(\d+)")
_TRACKER_STEP = re.compile(r"^Step (\d+):\s*$")
_NAMED_NUMBERS = re.compile(r"^[\w/@.\-]+: [-+\d.eE]+(?:, [\w/@.\-]+: [-+\d.eE]+)*$")


def _message(line: str) -> str:
    match = _LOGURU.match(line)
    return match.group(1) if match else line.strip()


def claims(text: str) -> int:
    return sum(1 for raw in text.splitlines() if _FINISHED.match(_message(clean_line(raw))))


class _Step:
    def __init__(self) -> None:
        self.metrics: dict[str, float] = {}
        self.number: int | None = None
        self.lines = 0

    def add_timer(self, name: str, seconds: float) -> None:
        key = f"timer/{name}"
        self.metrics[key] = self.metrics.get(key, 0.0) + seconds
        self.lines += 1


def parse(sources: list[tuple[str, str]], report: ParseReport) -> ParsedLog:
    parsed = ParsedLog(report)
    closed: list[_Step] = []
    numbered_by = set()
    before_first = 0
    for _, text in sources:
        current = _Step()  # timers of the step in progress (or of the one the log starts inside)
        in_step = False
        tracker: list[str] | None = None
        for raw in text.splitlines():
            report.lines_total += 1
            message = _message(clean_line(raw))
            if tracker is not None:  # the console tracker's multi-line dict
                tracker.append(message)
                joined = " ".join(tracker)
                if joined.count("{") and joined.count("{") == joined.count("}"):
                    _read_tracker(report, closed, joined)
                    tracker = None
                continue
            finished = _FINISHED.match(message)
            if finished is not None:
                name, seconds = finished.group(1), to_number(finished.group(2))
                if seconds is None:
                    report.skip("timer line whose time cost is not a number")
                    continue
                if name == "step":
                    current.metrics["timer/step"] = seconds
                    current.lines += 1
                    closed.append(current)
                    current, in_step = _Step(), False
                elif in_step or not closed:
                    current.add_timer(name, seconds)
                else:  # between two steps: SkyRL logs it with the step before
                    closed[-1].add_timer(name, seconds)
                continue
            started = _STARTED.match(message)
            if started is not None:
                if started.group(1) == "step":
                    if current.lines and not closed:
                        before_first += current.lines  # timers before the first step: no step's
                    current, in_step = _Step(), True
                continue
            bar = _BAR.search(message)
            if bar is not None:
                if closed and closed[-1].number is None:
                    closed[-1].number = int(bar.group(1))
                    numbered_by.add("the 'Training Batches Processed' bar")
                continue
            header = _TRACKER_STEP.match(message)
            if header is not None:
                if closed:
                    closed[-1].number = int(header.group(1))
                    numbered_by.add("the console tracker's 'Step N:'")
                tracker = []
                continue
            target = current if in_step or not closed else closed[-1]
            if message.startswith("{") and message.endswith("}"):
                value = literal_dict(message)
                if value is not None:
                    target.metrics.update(flatten(value))
            elif _NAMED_NUMBERS.match(message):
                for item in message.split(", "):
                    name, _, number = item.partition(": ")
                    value = to_number(number)
                    if value is not None:
                        target.metrics[name] = value
        if current.lines:
            report.skip("timer lines of a step the log ends inside (no \"Finished: 'step'\")", current.lines)
    _number_steps(parsed, closed, numbered_by)
    if before_first:
        report.note(f"{before_first} timer line{'s' if before_first != 1 else ''} before the first step "
                    "(initial weight sync, eval before training) belong to no step")
    return parsed


def _read_tracker(report: ParseReport, closed: list[_Step], text: str) -> None:
    value = literal_dict(text.strip())
    if value is None:
        report.skip("truncated or malformed console-tracker dict")
        return
    if not closed:
        return
    metrics = {}
    for key, item in value.items():
        number = to_number(item) if isinstance(item, str) else None
        if number is not None:
            metrics[key] = number
    metrics.update(flatten(value))
    closed[-1].metrics.update(metrics)


def _number_steps(parsed: ParsedLog, closed: list[_Step], numbered_by: set[str]) -> None:
    report = parsed.report
    previous = 0
    guessed = 0
    for step in closed:
        if step.number is None:
            step.number = previous + 1
            guessed += 1
        previous = step.number
        parsed.add(step.number, step.metrics)
        report.lines_used += step.lines
    if numbered_by:
        report.note(f"step numbers from {' and '.join(sorted(numbered_by))}")
    if guessed:
        report.note(f"{guessed} step{'s' if guessed != 1 else ''} numbered in order "
                    "(SkyRL's timer lines carry no step number)")
