"""knowledge.yaml: for each problem profiling can find, the fixes that have worked and when.

A fix sets *abstract* knobs (``micro_batch_size``, ``rl_mode``, ...); each job maps the knobs it can
express to its own config keys (job.yaml ``launch.knob_map``), and ``knobs.<name>.keys`` records the
usual key of that knob in common frameworks as a hint for writing a knob_map.

An override value is either a literal or a relative change of the current value, written as a
string: ``'*2'``, ``'/2'``, ``'+1'``, ``'-1'`` (clamped to the knob's ``min``/``max``).

A condition (``applies_when``) is one comparison ``NAME OP VALUE``: NAME is a knob or a job fact
(``workload.kind``, ``model.moe``, ``gpus.count``, ...), OP is one of ``== != < <= > >= in``, VALUE
is a YAML scalar or, for ``in``, a YAML list: ``workload.kind in [coding, tool_use]``.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from rltune.contracts.job import KnobValue
from rltune.contracts.schema import FieldProblem, dump_yaml, field, load_yaml, parse_yaml
from rltune.errors import DuplicateKeyError

KNOWLEDGE_SCHEMA_VERSION = 1

TheoryTerm = Literal["training", "rollout", "weight_sync", "sandbox", "old_logprob", "step"]
# The theory terms inside each stage group a step is limited by ('training+weight_sync' in fully async).
STAGE_GROUP_TERMS: dict[str, frozenset[str]] = {
    "rollout": frozenset({"rollout", "sandbox"}), "training": frozenset({"training", "old_logprob"}),
    "weight_sync": frozenset({"weight_sync"}), "training+weight_sync": frozenset({"training", "old_logprob", "weight_sync"})}


def moves_group(moves: list[str] | tuple[str, ...], group: str) -> bool:
    """Whether fixes that move these theory terms move the time of stage group ``group``."""
    return bool(STAGE_GROUP_TERMS.get(group, frozenset({group})) & set(moves))


LimitName = Literal["gap", "sample_age", "trials_cut_off", "trials_failed", "memory", "reward"]

_CONDITION = re.compile(r"^\s*([A-Za-z_][\w.]*)\s*(==|!=|<=|>=|<|>|\bin\b)\s*(.+?)\s*$")
_RELATIVE = re.compile(r"^([*/+-])\s*(\d+(?:\.\d+)?)$")


@dataclass(frozen=True)
class Condition:
    """One parsed ``applies_when`` comparison."""

    name: str
    op: str
    value: Any


def parse_condition(text: str) -> Condition:
    """Parse ``'NAME OP VALUE'``; raise ValueError with what is wrong."""
    import yaml

    match = _CONDITION.match(text)
    if not match:
        raise ValueError(f"cannot read condition {text!r}; write 'NAME OP VALUE', OP one of == != < <= > >= in")
    name, op, raw = match.groups()
    try:
        value = parse_yaml(raw, "condition")
    except (yaml.YAMLError, DuplicateKeyError):
        raise ValueError(f"cannot read the value of condition {text!r}") from None
    if op == "in" and not isinstance(value, list):
        raise ValueError(f"condition {text!r}: 'in' needs a list, e.g. [a, b]")
    if op in ("<", "<=", ">", ">=") and (isinstance(value, bool) or not isinstance(value, (int, float))):
        raise ValueError(f"condition {text!r}: {op} needs a number")
    return Condition(name, op, value)


def parse_relative(value: KnobValue) -> tuple[str, float] | None:
    """``'*2'`` -> ('*', 2.0); a literal value -> None."""
    if not isinstance(value, str):
        return None
    match = _RELATIVE.match(value.strip())
    return (match.group(1), float(match.group(2))) if match else None


@dataclass
class KnobInfo:
    description: str = field(doc="what the knob does")
    type: Literal["int", "float", "bool", "str"] = field(doc="value type")
    choices: list[KnobValue] | None = field(None, doc="allowed values, if a fixed set")
    min: float | None = field(None, doc="smallest value a relative override may reach", min=-1e12, max=1e12)
    max: float | None = field(None, doc="largest value a relative override may reach", min=-1e12, max=1e12)
    keys: dict[str, str] = field(default_factory=dict, doc="framework -> its usual config key for this knob (a hint for launch.knob_map)")

    def validate(self) -> None:
        numeric = self.type in ("int", "float")
        for bound in ("min", "max"):
            if getattr(self, bound) is not None and not numeric:
                raise FieldProblem(bound, f"only a numeric knob has a {bound}; this one is {self.type}")
        if self.min is not None and self.max is not None and self.min > self.max:
            raise FieldProblem("min", f"min ({self.min:g}) is above max ({self.max:g}); swap them")
        if self.type == "int":
            for bound in ("min", "max"):
                value = getattr(self, bound)
                if value is not None and value != int(value):
                    raise FieldProblem(bound, f"an int knob's {bound} is a whole number, found {value:g}")
        for i, choice in enumerate(self.choices or ()):
            if not _is_type(choice, self.type):
                raise FieldProblem(f"choices[{i}]", f"expected {'an' if self.type == 'int' else 'a'} {self.type} value, "
                                                    f"found {choice!r}")
            if numeric and ((self.min is not None and choice < self.min) or (self.max is not None and choice > self.max)):
                raise FieldProblem(f"choices[{i}]", f"{choice!r} lies outside the knob's min and max")


def _is_type(value: KnobValue, kind: str) -> bool:
    """Whether ``value`` is a value of knob type ``kind`` (an int is a float; a bool is neither)."""
    if kind == "bool":
        return isinstance(value, bool)
    if isinstance(value, bool):
        return False
    return isinstance(value, {"int": int, "float": (int, float), "str": str}[kind])


@dataclass
class Fix:
    id: str = field(doc="stable fix id")
    title: str = field(doc="one line for a person")
    problems: list[str] = field(doc="problem ids this fix addresses")
    overrides: dict[str, KnobValue] = field(doc="abstract knob -> value; a string '*2', '/2', '+1' or '-1' changes the current value")
    group: str = field("other", doc="technique group the savings matrix counts it under (e.g. 'async', 'trainer', 'engine')")
    applies_when: list[str] = field(default_factory=list, doc="conditions on knobs or job facts, e.g. 'rl_mode != fully_async', 'workload.kind == coding'")
    conflicts: list[str] = field(default_factory=list, doc="fix ids this fix cannot be combined with")
    needs: list[str] = field(default_factory=list, doc="resources it needs beyond the budget, e.g. 'extra_cpu_host'")
    moves: list[TheoryTerm] = field(default_factory=list, doc="theory terms the fix changes")
    risks: list[LimitName] = field(default_factory=list, doc="acceptance limits it may break")
    source: str = field("", doc="where the practice comes from (seed, verl, prime-rl, vLLM docs)")

    def conditions(self) -> list[Condition]:
        return [parse_condition(c) for c in self.applies_when]


@dataclass
class Knowledge:
    schema_version: int = field(doc="version of this schema (1)")
    knobs: dict[str, KnobInfo] = field(doc="every abstract knob fixes may set")
    problems: dict[str, str] = field(doc="problem id -> description")
    fixes: list[Fix] = field(doc="problem -> fix entries")

    def validate(self) -> None:
        for name, text in self.problems.items():
            if not text.strip():
                raise FieldProblem(f"problems.{name}", "describe the problem in one line")
        ids = [f.id for f in self.fixes]
        for i, fix in enumerate(self.fixes):
            if not fix.id.strip():
                raise FieldProblem(f"fixes[{i}].id", "a fix needs an id (the name candidates and conflicts use)")
            if ids.count(fix.id) > 1:
                raise FieldProblem(f"fixes[{i}].id", f"duplicate fix id {fix.id!r}")
            if not fix.problems:
                raise FieldProblem(f"fixes[{i}].problems", "a fix must address at least one problem")
            for p in fix.problems:
                if p not in self.problems:
                    raise FieldProblem(f"fixes[{i}].problems", f"unknown problem {p!r}; define it under 'problems'")
            if not fix.overrides:
                raise FieldProblem(f"fixes[{i}].overrides", "a fix must set at least one knob")
            for knob, value in fix.overrides.items():
                if knob not in self.knobs:
                    raise FieldProblem(f"fixes[{i}].overrides.{knob}", "unknown knob; define it under 'knobs'")
                self._check_value(f"fixes[{i}].overrides.{knob}", self.knobs[knob], value)
            for j, text in enumerate(fix.applies_when):
                try:
                    parse_condition(text)
                except ValueError as exc:
                    raise FieldProblem(f"fixes[{i}].applies_when[{j}]", str(exc)) from None
            for other in fix.conflicts:
                if other not in ids:
                    raise FieldProblem(f"fixes[{i}].conflicts", f"unknown fix {other!r}")
                if other == fix.id:
                    raise FieldProblem(f"fixes[{i}].conflicts", "a fix cannot conflict with itself")

    @staticmethod
    def _check_value(where: str, info: KnobInfo, value: KnobValue) -> None:
        relative = parse_relative(value)
        if relative is not None:
            if info.type not in ("int", "float"):
                raise FieldProblem(where, f"relative change {value!r} needs a numeric knob, this one is {info.type}")
            op, amount = relative
            if amount == 0 and op in "*/":
                raise FieldProblem(where, f"relative change {value!r} {'divides by' if op == '/' else 'multiplies by'} "
                                          "zero; give a literal value instead")
            return
        if not _is_type(value, info.type):
            raise FieldProblem(where, f"expected {'an' if info.type == 'int' else 'a'} {info.type} value "
                                      f"(or '*2', '/2', '+1', '-1'), found {value!r}")
        if info.choices is not None and value not in info.choices:
            raise FieldProblem(where, f"expected one of {info.choices}, found {value!r}")
        if info.type in ("int", "float") and info.min is not None and value < info.min:
            raise FieldProblem(where, f"{value!r} is below the knob's min ({info.min:g})")
        if info.type in ("int", "float") and info.max is not None and value > info.max:
            raise FieldProblem(where, f"{value!r} is above the knob's max ({info.max:g})")

    def fix(self, fix_id: str) -> Fix:
        for f in self.fixes:
            if f.id == fix_id:
                return f
        raise KeyError(fix_id)


def load_knowledge(path: str | Path) -> Knowledge:
    return load_yaml(Knowledge, path, KNOWLEDGE_SCHEMA_VERSION)


# The knowledge base shipped with rltune: its knob table is the registry of abstract knob names.
SHIPPED_KNOWLEDGE = Path(__file__).resolve().parents[2] / "presets" / "knowledge.yaml"


@functools.lru_cache(maxsize=4)
def _knob_table(path: str, mtime_ns: int) -> dict[str, KnobInfo]:
    return dict(load_knowledge(path).knobs)


def shipped_knobs() -> dict[str, KnobInfo]:
    """The shipped knowledge base's knobs (type, bounds, choices); empty where it cannot be read
    (its own loader reports that, when a command reads it)."""
    from rltune.errors import RltuneError

    try:
        return _knob_table(str(SHIPPED_KNOWLEDGE), SHIPPED_KNOWLEDGE.stat().st_mtime_ns)
    except (OSError, RltuneError):
        return {}


def save_knowledge(knowledge: Knowledge, path: str | Path) -> None:
    dump_yaml(knowledge, path)
