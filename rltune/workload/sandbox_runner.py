"""The command language a tool-use sandbox executes: one model turn in, its output out.

Run as ``python -I -S sandbox_runner.py '<turn text>'`` inside a trial's directory, under the
sandbox's CPU, memory and wall-clock limits. Whatever a (random) model writes is interpreted
safely: the first word picks a command from an allow-list, file names must be plain names in the
trial directory, arithmetic goes through an AST allow-list. Anything else prints an error line.
This file imports only the standard library; it must not import rltune.

Commands: ls | cat NAME | sum NAME | wc NAME | calc EXPR | run MODULE

``--tests N`` after the turn text runs N of the task's test cases once the command is done (the
environment's check, as an agent's harness runs a task's tests): case i imports library module
``i mod modules``, runs its helper over its data ``CASE_REPEAT`` times and writes the result to
``results/case<i>.txt``. Real CPU and file-system work, in proportion to N.
"""

import ast
import importlib.util
import operator
import os
import sys

MAX_OUTPUT = 200
# Helper calls per test case: about 1.3 ms of CPU a case (with its file) on one core of the development machine.
CASE_REPEAT = 40
_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def _safe_name(name):
    if not name or "/" in name or name.startswith(".") or "\\" in name:
        raise ValueError(f"bad file name {name!r}")
    return name


def _calc(node):
    if isinstance(node, ast.Expression):
        return _calc(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        left, right = _calc(node.left), _calc(node.right)
        if abs(left) > 10**12 or abs(right) > 10**12:
            raise ValueError("number too large")
        return _BINOPS[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_calc(node.operand)
    raise ValueError("only integers, + - * and parentheses")


def _read(name):
    with open(_safe_name(name), encoding="utf-8", errors="replace") as handle:
        return handle.read()


def execute(turn):
    words = turn.strip().split("\n", 1)[0].split()
    if not words:
        return "error: empty command"
    cmd, args = words[0], words[1:]
    if cmd == "ls":
        return " ".join(sorted(os.listdir(".")))
    if cmd == "cat" and len(args) == 1:
        return _read(args[0])
    if cmd == "wc" and len(args) == 1:
        return str(len(_read(args[0]).splitlines()))
    if cmd == "sum" and len(args) == 1:
        return str(sum(int(tok) for tok in _read(args[0]).split() if tok.lstrip("-").isdigit()))
    if cmd == "calc" and args:
        return str(_calc(ast.parse(" ".join(args), mode="eval")))
    if cmd == "run" and len(args) == 1:
        path = os.path.join("lib", _safe_name(args[0]) + ".py")
        spec = importlib.util.spec_from_file_location(args[0], path)
        if spec is None or not os.path.exists(path):
            raise ValueError(f"no module {args[0]!r}")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return str(module.main())
    return f"error: unknown command {cmd[:20]!r} (ls, cat, sum, wc, calc, run)"


def run_tests(cases):
    """Run ``cases`` test cases of the image's library; a one-line summary."""
    names = sorted(name[:-3] for name in os.listdir("lib") if name.endswith(".py")) if os.path.isdir("lib") else []
    if not names or cases <= 0:
        return "tests: none"
    os.makedirs("results", exist_ok=True)
    loaded = {}
    failed = 0
    for case in range(cases):
        name = names[case % len(names)]
        if name not in loaded:
            spec = importlib.util.spec_from_file_location(name, os.path.join("lib", name + ".py"))
            loaded[name] = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(loaded[name])
        values = [loaded[name].main() for _ in range(CASE_REPEAT)]
        failed += len(set(values)) != 1  # a helper is deterministic: two answers would be a failing test
        with open(os.path.join("results", f"case{case}.txt"), "w", encoding="utf-8") as handle:
            handle.write(f"{name} {values[0]}\n")
    return f"tests: {cases - failed} passed, {failed} failed"


def main():
    args = sys.argv[1:]
    tests = 0
    if len(args) >= 3 and args[-2] == "--tests" and args[-1].isdigit():
        tests, args = int(args[-1]), args[:-2]
    turn = args[0] if args else ""
    try:
        out = execute(turn)
    except (ValueError, OSError, SyntaxError, RecursionError, ZeroDivisionError) as exc:
        out = f"error: {exc}"
    if tests:
        out = out[:MAX_OUTPUT] + "\n" + run_tests(tests)
    sys.stdout.write(out[:MAX_OUTPUT * 2])


if __name__ == "__main__":
    main()
