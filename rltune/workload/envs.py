"""The two environments' tasks, verifier and reward (pure functions; the sandbox runs the tools).

math: a short arithmetic expression; the model answers with an integer after ``=``.
tool use: a data file lives in the trial's sandbox; the model may run commands (``cat data.txt``,
``sum data.txt``, ``calc 3+4``, ...) over several turns and ends with ``answer N``.

Reward: 1 for an exactly right answer; otherwise partial credit so that a group of trials of a
random model rarely has all-equal rewards (which would make every GRPO advantage zero):
0.1 for a well-formed integer plus up to 0.4 for digits in the right places.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field

_INTEGER = re.compile(r"-?\d+")


@dataclass(frozen=True)
class Task:
    task_id: str
    prompt: str
    answer: str
    files: dict[str, str] = field(default_factory=dict)


def make_math_task(rng: random.Random, task_id: str, max_operand: int = 99, max_terms: int = 3,
                   operators: str = "+-*") -> Task:
    """``a op b`` (up to ``max_terms`` operands) with operands in 0..max_operand; the answer is its integer value.

    The defaults draw from the generator exactly as before these parameters existed, so a seed
    gives the same tasks it always gave; ``max_operand=9, max_terms=2, operators="+"`` are the
    one-digit sums a randomly initialised model can learn within a few hundred steps.
    """
    operands = [rng.randint(0, max_operand) for _ in range(rng.choice(range(2, max_terms + 1)))]
    ops = [rng.choice(operators) for _ in operands[1:]]
    expr = str(operands[0]) + "".join(f"{op}{value}" for op, value in zip(ops, operands[1:], strict=True))
    return Task(task_id, f"{expr}=", str(_evaluate(expr)))


def _evaluate(expr: str) -> int:
    # Precedence of * over + and -, left to right otherwise; the expression holds only our tokens.
    terms = re.findall(r"[+-]?[^+-]+", expr)
    total = 0
    for term in terms:
        sign = -1 if term.startswith("-") else 1
        product = 1
        for factor in term.lstrip("+-").split("*"):
            product *= int(factor)
        total += sign * product
    return total


TOOL_PROMPT = "Find the sum of the numbers in data.txt. Tools: ls, cat F, sum F, calc E. End with: answer N\n$ "


def make_tool_task(rng: random.Random, task_id: str) -> Task:
    numbers = [rng.randint(1, 50) for _ in range(rng.randint(3, 6))]
    return Task(task_id, TOOL_PROMPT, str(sum(numbers)), {"data.txt": " ".join(map(str, numbers)) + "\n"})


def extract_answer(text: str) -> str | None:
    """The first integer of a model's answer text (after an optional 'answer' keyword), or None."""
    text = text.strip()
    if text.startswith("answer"):
        text = text[len("answer"):].strip()
    match = _INTEGER.match(text)
    return match.group(0) if match else None


def verify(text: str, answer: str) -> bool:
    """Exact verifier: the answer text's leading integer equals the true answer."""
    got = extract_answer(text)
    return got is not None and int(got) == int(answer)


def partial_credit(text: str, answer: str) -> float:
    """1.0 if exact; else 0.1 for a leading integer plus 0.4 x the share of digits in the right place."""
    if verify(text, answer):
        return 1.0
    got = extract_answer(text)
    if got is None:
        # Any digit at all earns a sliver, so even a random model's group has some spread.
        return 0.05 if any(ch.isdigit() for ch in text) else 0.0
    matched = sum(1 for a, b in zip(got, answer, strict=False) if a == b)
    return 0.1 + 0.4 * matched / max(len(got), len(answer))


def tool_observation(output: str) -> str:
    """How a sandbox command's output is fed back as the next turn's observation."""
    return "\n" + output.strip()[:60] + "\n$ "
