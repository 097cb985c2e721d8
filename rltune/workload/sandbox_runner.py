"""The command language a tool-use sandbox executes: one model turn in, its output out.

Run as ``python -I -S sandbox_runner.py '<turn text>'`` inside a trial's directory, under the
sandbox's CPU, memory and wall-clock limits. Whatever a (random) model writes is interpreted
safely: the first word picks a command from an allow-list, file names must be plain names in the
trial directory, arithmetic goes through an AST allow-list. Anything else prints an error line.
This file imports only the standard library; it must not import rltune.

Commands: ls | cat NAME | sum NAME | wc NAME | calc EXPR | run MODULE
"""

import ast
import importlib.util
import operator
import os
import sys

MAX_OUTPUT = 200
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


def main():
    turn = sys.argv[1] if len(sys.argv) > 1 else ""
    try:
        out = execute(turn)
    except (ValueError, OSError, SyntaxError, RecursionError, ZeroDivisionError) as exc:
        out = f"error: {exc}"
    sys.stdout.write(out[:MAX_OUTPUT])


if __name__ == "__main__":
    main()
