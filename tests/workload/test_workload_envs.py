"""Tasks, verifier, partial credit and the shipped tokenizer."""

from __future__ import annotations

import random

import pytest

from rltune.workload.envs import (
    _evaluate,
    extract_answer,
    make_math_task,
    make_tool_task,
    partial_credit,
    verify,
)
from rltune.workload.tokenizer import TOKENIZER


@pytest.mark.parametrize("expr", ["1+2", "12-30", "7*8", "2+3*4", "10-2*3-1", "0*99+5", "99*99*99"])
def test_evaluator_agrees_with_python_precedence(expr):
    assert _evaluate(expr) == eval(expr)  # noqa: S307 - fixed literal expressions


def test_math_tasks_are_seeded_and_their_answers_are_right():
    a = [make_math_task(random.Random(3), f"t{i}") for i in range(5)]
    b = [make_math_task(random.Random(3), f"t{i}") for i in range(5)]
    assert a == b
    for task in [make_math_task(random.Random(seed), "t") for seed in range(50)]:
        assert task.prompt.endswith("=")
        assert int(task.answer) == eval(task.prompt[:-1])  # noqa: S307


def test_math_task_defaults_draw_the_tasks_the_generator_always_drew():
    # Recorded before the difficulty parameters existed: env.seed 0's first tasks must not move,
    # or every earlier run and case of the tiny math job would have been made on other tasks.
    tasks = [make_math_task(rng, f"t{i}") for rng in [random.Random(0)] for i in range(4)]
    assert [t.prompt for t in tasks] == ["97-53*5=", "51-38*61=", "64-17=", "96*12="]


def test_easy_math_tasks_are_one_digit_sums():
    rng = random.Random(0)
    tasks = [make_math_task(rng, f"t{i}", max_operand=9, max_terms=2, operators="+") for i in range(200)]
    assert all(len(t.prompt) == 4 and t.prompt[1] == "+" for t in tasks)
    assert {int(t.answer) for t in tasks} == set(range(19))


def test_tool_task_answer_is_the_sum_of_its_data_file():
    task = make_tool_task(random.Random(1), "t0")
    assert int(task.answer) == sum(int(x) for x in task.files["data.txt"].split())


@pytest.mark.parametrize(("text", "answer", "ok"), [
    ("42", "42", True), (" 42<junk", "42", True), ("answer 42", "42", True), ("-7", "-7", True),
    ("042", "42", True), ("43", "42", False), ("x42", "42", False), ("", "0", False), ("answer", "1", False),
])
def test_verifier(text, answer, ok):
    assert verify(text, answer) is ok


def test_partial_credit_orders_answers_by_closeness():
    assert partial_credit("123", "123") == 1.0
    assert partial_credit("124", "123") == pytest.approx(0.1 + 0.4 * 2 / 3)
    assert partial_credit("999", "123") == pytest.approx(0.1)
    assert partial_credit("1", "123") == pytest.approx(0.1 + 0.4 * 1 / 3)
    assert partial_credit("zz9", "123") == pytest.approx(0.05)
    assert partial_credit("zzz", "123") == 0.0
    assert extract_answer("answer  -12 done") == "-12"
    assert extract_answer("abc") is None


def test_tokenizer_round_trips_every_prompt_character_and_marks_unknowns():
    text = make_tool_task(random.Random(0), "t").prompt + "calc (3+4)*2\n> 14"
    ids = TOKENIZER.encode(text, bos=True)
    assert ids[0] == TOKENIZER.bos_id
    assert TOKENIZER.unk_id not in ids
    assert TOKENIZER.decode(ids) == text
    assert TOKENIZER.encode("é") == [TOKENIZER.unk_id]
    assert TOKENIZER.decode([TOKENIZER.eos_id, 5, TOKENIZER.pad_id]) == TOKENIZER.id_to_token[5]
    assert len(set(TOKENIZER.id_to_token)) == TOKENIZER.vocab_size
