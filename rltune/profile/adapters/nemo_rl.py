"""NeMo-RL: the console block printed after each GRPO step.

    ========================= Step 3/100 =========================
    ...
    📊 Training Results:
      • Loss: 0.0271
      • Avg Reward: 0.1016
    ⏱️  Timing:
      • Total step time: 94.87s
      • generation: 44.62s (47.0%)
      • policy_training: 30.21s (31.8%)
      • prepare_for_generation/total: 4.33s (4.6%)

Bullets under "Timing" become ``timing/<name>`` (``Total step time`` -> ``timing/total_step_time``,
``prepare_for_generation/total`` -> ``timing/prepare_for_generation/total``); other bullets keep
their label (``Avg Reward``, ``Avg Trajectory Age``). ``-`` sub-bullets (throughputs under
"Performance Metrics", or under a timing line) keep their label and are never timings.

Timing names, from NeMo-RL's ``grpo.py`` (the stage map in rltune/profile/stage_map.py says which
fills which column): synchronous GRPO times ``generation``, ``reward_calculation``,
``prepare_for_generation/total`` (weights to the engines and the engines' wake-up, with
``prepare_for_generation/transfer_and_update_weights`` inside it), ``logprob_inference_prep``,
``policy_and_reference_logprobs`` (with ``policy_logprobs`` / ``reference_logprobs`` inside it),
``training_prep``, ``policy_training``, ``advantage_calculation``, ``data_processing``,
``checkpointing``. Asynchronous GRPO replaces ``generation`` by ``exposed_generation`` — the time
the trainer waited for the replay buffer, not the generation itself, which runs alongside — and
``prepare_for_generation`` by ``weight_sync``.

A block that never reaches its timing section (a log cut mid-step) is skipped and counted. A block
printed without its ``Step N/M`` header (a log pasted from the results section on) is read too,
numbered in order from 1, and the report says so.

Real sample: tests/profiling/data/nemo_rl_async_grpo_timing_pr1052.log (NVIDIA-NeMo/RL#1052).
"""

from __future__ import annotations

import re

from rltune.profile.adapters._text import ParsedLog, clean_line, to_number
from rltune.profile.report import ParseReport

NAME = "nemo-rl"
_HEADER = re.compile(r"^=+\s*Step (\d+)/(\d+)\s*=+\s*$")
_BULLET = re.compile(r"^\s*([•*\-])\s+([^:]+):\s+(\S+)")
_TIMING_TITLE = re.compile(r"Timing:\s*$")
_RESULTS_TITLE = re.compile(r"Training Results:\s*$")
_TOTAL = re.compile(r"^\s*•\s+Total step time:\s+\S+")
_SECTION_TITLE = re.compile(r":\s*$")


def claims(text: str) -> int:
    count = 0
    for raw in text.splitlines():
        line = clean_line(raw).strip()
        if _HEADER.match(line) or _TOTAL.match(line):
            count += 1
    return count


def _timing_key(label: str) -> str:
    return "timing/" + re.sub(r"\s+", "_", label.strip().lower())


class _Block:
    def __init__(self, step: int | None, header_line: bool):
        self.step = step
        self.metrics: dict[str, float] = {}
        self.in_timing = False
        self.used = 1 if header_line else 0


def parse(sources: list[tuple[str, str]], report: ParseReport) -> ParsedLog:
    parsed = ParsedLog(report)
    headerless = 0
    last_step = 0

    def close(block: _Block | None) -> None:
        nonlocal last_step, headerless
        if block is None:
            return
        if "timing/total_step_time" not in block.metrics:
            if block.used:
                report.skip("step block without 'Total step time' (log cut mid-step?)", block.used)
            return
        if block.step is None:
            block.step = last_step + 1
            headerless += 1
        last_step = block.step
        parsed.add(block.step, block.metrics)
        report.lines_used += block.used

    for _, text in sources:
        block: _Block | None = None
        for raw in text.splitlines():
            report.lines_total += 1
            line = clean_line(raw).strip()
            header = _HEADER.match(line)
            if header is not None:
                close(block)
                block = _Block(int(header.group(1)), header_line=True)
                continue
            starts_results = _RESULTS_TITLE.search(line) is not None
            starts_timing = _TIMING_TITLE.search(line) is not None
            if block is None or (block.step is None and (
                    (starts_results and block.metrics) or
                    (starts_timing and "timing/total_step_time" in block.metrics))):
                if not (starts_results or starts_timing):
                    continue
                # No 'Step N/M' header: a results or timing section opens a block of its own.
                close(block)
                block = _Block(None, header_line=False)
            if starts_timing:
                block.in_timing = True
                continue
            bullet = _BULLET.match(line)
            if bullet is not None:
                value = to_number(bullet.group(3))
                if value is None:
                    continue
                label = bullet.group(2).strip()
                timing = block.in_timing and bullet.group(1) == "•"
                block.metrics[_timing_key(label) if timing else label] = value
                block.used += 1
            elif line and _SECTION_TITLE.search(line) and not line.startswith("▶"):
                block.in_timing = False
        close(block)
    if headerless:
        report.note(f"{headerless} step block{'s' if headerless != 1 else ''} without a 'Step N/M' header: "
                    "numbered in order from 1")
    return parsed
