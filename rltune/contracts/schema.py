"""Declarative schemas for the YAML artifacts, with strict, located validation.

Every YAML artifact is a tree of frozen-ish dataclasses. :func:`from_data` walks a parsed mapping
against such a dataclass and raises an :class:`~rltune.errors.ArtifactError` subclass that names the
file, the dotted field path, what was expected and what was found:

    job.yaml: launch.comand: unknown key (did you mean 'command'?)

Supported field types: ``int``, ``float`` (ints accepted), ``str``, ``bool``, ``Any``, ``Literal``,
``X | None``, ``list[T]``, ``dict[str, T]``, unions of scalars, and nested dataclasses. A field's
``metadata`` may carry ``doc`` (one line, used by docs/artifacts.md), ``min`` and ``max``.
Validation of cross-field rules lives in each dataclass's ``validate(path)`` method, which may raise
:class:`FieldProblem`; the loader turns it into a located error.

YAML is only ever read with a safe loader (:func:`parse_yaml`), which refuses a key repeated in one
mapping at any depth: YAML itself would keep the last value without a word.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
import tempfile
import types
from pathlib import Path
from typing import Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

from rltune.errors import (
    MalformedFileError,
    MissingFieldError,
    SchemaVersionError,
    UnknownKeyError,
    WrongTypeError,
)

T = TypeVar("T")
_YAML11_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


class FieldProblem(Exception):
    """Raised by a dataclass ``validate`` hook: (relative field, problem). Never escapes a loader."""

    def __init__(self, field: str, problem: str):
        super().__init__(problem)
        self.field = field
        self.problem = problem


def field(default: Any = dataclasses.MISSING, *, doc: str = "", min: float | None = None,
          max: float | None = None, default_factory: Any = dataclasses.MISSING) -> Any:
    """A dataclass field carrying a one-line ``doc`` and optional numeric bounds."""
    meta = {"doc": doc, "min": min, "max": max}
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def _describe(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"boolean {value!r}"
    if isinstance(value, (int, float)):
        return f"number {value!r}"
    if isinstance(value, str):
        shown = value if len(value) <= 40 else value[:37] + "..."
        return f"string {shown!r}"
    if isinstance(value, list):
        return f"a list of {len(value)}"
    if isinstance(value, dict):
        return "a mapping"
    return type(value).__name__


def _type_name(tp: Any) -> str:
    origin = get_origin(tp)
    if tp is Any:
        return "any value"
    if tp is type(None):
        return "null"
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in get_args(tp))
    if origin is list:
        return f"a list of {_type_name(get_args(tp)[0])}"
    if origin is dict:
        return f"a mapping of names to {_type_name(get_args(tp)[1])}"
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(tp, str(tp))


def _join(path: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else str(key)


def _convert(tp: Any, value: Any, file: str, path: str, meta: dict | None = None) -> Any:
    origin = get_origin(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        options = get_args(tp)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _convert(option, value, file, path, meta)
            except WrongTypeError as exc:
                errors.append(exc)
        if len(errors) == 1:
            raise errors[0]
        raise WrongTypeError(file, path, f"expected {_type_name(tp)}, found {_describe(value)}")
    if origin is Literal:
        choices = get_args(tp)
        if value not in choices or isinstance(value, bool) != any(isinstance(c, bool) for c in choices):
            hint = ""
            if isinstance(value, str):
                close = difflib.get_close_matches(value, [str(c) for c in choices], n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise WrongTypeError(file, path, f"expected {_type_name(tp)}, found {_describe(value)}{hint}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise WrongTypeError(file, path, f"expected {_type_name(tp)}, found {_describe(value)}")
        (item_tp,) = get_args(tp)
        return [_convert(item_tp, v, file, _join(path, i)) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise WrongTypeError(file, path, f"expected {_type_name(tp)}, found {_describe(value)}")
        _, val_tp = get_args(tp)
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise WrongTypeError(file, _join(path, str(k)), f"keys must be strings, found {_describe(k)}")
            out[k] = _convert(val_tp, v, file, _join(path, k))
        return out
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, file, path)
    if tp is bool:
        if not isinstance(value, bool):
            raise WrongTypeError(file, path, f"expected true or false, found {_describe(value)}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise WrongTypeError(file, path, f"expected an integer, found {_describe(value)}")
        _check_bounds(value, file, path, meta)
        return value
    if tp is float:
        if isinstance(value, str) and _YAML11_FLOAT.fullmatch(value.strip()):
            value = float(value)  # PyYAML reads '2.0e6' (no exponent sign) as a string
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise WrongTypeError(file, path, f"expected a number, found {_describe(value)}")
        if not math.isfinite(value):
            raise WrongTypeError(file, path, f"expected a finite number, found {value!r}; give a real value")
        _check_bounds(value, file, path, meta)
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise WrongTypeError(file, path, f"expected a string, found {_describe(value)}")
        return value
    raise TypeError(f"schema type {tp!r} at {path} is not supported")  # a bug in a schema, not in input


def _check_bounds(value: float, file: str, path: str, meta: dict | None) -> None:
    if not meta:
        return
    lo, hi = meta.get("min"), meta.get("max")
    if lo is not None and value < lo:
        raise WrongTypeError(file, path, f"expected a value >= {_number(lo)}, found {_number(value)}")
    if hi is not None and value > hi:
        raise WrongTypeError(file, path, f"expected a value <= {_number(hi)}, found {_number(value)}")


def _number(value: float) -> str:
    """A bound or value as a person writes it: 10000, 0.05, 1e+15 (not 1000000000000000.0)."""
    if isinstance(value, int):
        return str(value) if abs(value) < 10**12 else f"{value:g}"
    return f"{value:g}" if abs(value) >= 1e6 or 0 < abs(value) < 1e-4 else repr(value)


def _build(cls: type[T], data: Any, file: str, path: str) -> T:
    if not isinstance(data, dict):
        raise WrongTypeError(file, path, f"expected a mapping, found {_describe(data)}")
    hints = get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    for key in data:
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1, cutoff=0.6)
            hint = f" (did you mean {close[0]!r}?)" if close else f" (known keys: {', '.join(fields)})"
            raise UnknownKeyError(file, _join(path, str(key)), "unknown key" + hint)
    kwargs = {}
    for name, f in fields.items():
        if name in data:
            kwargs[name] = _convert(hints[name], data[name], file, _join(path, name), dict(f.metadata))
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise MissingFieldError(file, _join(path, name), f"missing required field ({_type_name(hints[name])})")
    obj = cls(**kwargs)
    validate = getattr(obj, "validate", None)
    if validate is not None:
        try:
            validate()
        except FieldProblem as problem:
            raise WrongTypeError(file, _join(path, problem.field), problem.problem) from None
    return obj


def from_data(cls: type[T], data: Any, file: str | os.PathLike, path: str = "") -> T:
    """Validate ``data`` (parsed YAML/JSON) against dataclass ``cls``; raise located errors."""
    return _build(cls, data, str(file), path)


def to_data(obj: Any) -> Any:
    """The plain (YAML-safe) form of a schema object: dataclasses become dicts, in field order."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_data(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {k: to_data(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_data(v) for v in obj]
    return obj


def check_schema_version(data: Any, file: str, supported: int) -> None:
    """Refuse a file whose ``schema_version`` is absent, malformed or newer than ``supported``."""
    if not isinstance(data, dict):
        raise MalformedFileError(file, "", f"expected a YAML mapping at the top level, found {_describe(data)}")
    version = data.get("schema_version")
    if version is None:
        raise MissingFieldError(file, "schema_version", f"missing; add 'schema_version: {supported}'")
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise WrongTypeError(file, "schema_version", f"expected a positive integer, found {_describe(version)}")
    if version > supported:
        raise SchemaVersionError(
            file, "schema_version",
            f"written by a newer rltune (version {version}; this rltune reads up to {supported}); upgrade rltune",
        )


def check_parquet_version(metadata: dict | None, file: str, supported: int, how_to_write: str) -> int:
    """Refuse a Parquet file whose ``rltune.schema_version`` metadata is absent, malformed or too new.

    ``how_to_write`` completes the fix of a missing version, e.g. "write it with 'rltune profile'".
    """
    raw = (metadata or {}).get(b"rltune.schema_version")
    if raw is None:
        raise MissingFieldError(file, "schema_version", f"no rltune.schema_version in the Parquet metadata; {how_to_write}")
    try:
        version = int(raw)
    except ValueError:
        raise WrongTypeError(file, "schema_version", f"expected an integer, found {raw!r}") from None
    if version > supported:
        raise SchemaVersionError(
            file, "schema_version",
            f"written by a newer rltune (version {version}; this rltune reads up to {supported}); upgrade rltune",
        )
    return version


def _yaml_loader() -> type:
    """The safe loader rltune reads every YAML file with (the C parser where PyYAML has it)."""
    import yaml

    return getattr(yaml, "CSafeLoader", yaml.SafeLoader)


_MERGE_TAG = "tag:yaml.org,2002:merge"


def _check_duplicate_keys(node: Any, file: str) -> None:
    """Refuse a mapping, at any depth, that names one key twice (YAML keeps the last one silently)."""
    import yaml

    seen_nodes: set[int] = set()
    stack: list[tuple[Any, str]] = [(node, "")]
    while stack:
        current, path = stack.pop()
        if id(current) in seen_nodes:  # an alias: checked where its anchor is
            continue
        seen_nodes.add(id(current))
        if isinstance(current, yaml.MappingNode):
            first_line: dict[tuple[str, str], int] = {}
            children = []
            for key_node, value_node in current.value:
                if key_node.tag == _MERGE_TAG or not isinstance(key_node, yaml.ScalarNode):
                    children.append((value_node, path))
                    continue
                key = (key_node.tag, key_node.value)
                where = _join(path, key_node.value)
                line = key_node.start_mark.line + 1
                if key in first_line:
                    from rltune.errors import DuplicateKeyError

                    raise DuplicateKeyError(file, where, f"duplicate key (the first is on line {first_line[key]}); "
                                                         "keep one", line=line)
                first_line[key] = line
                children.append((value_node, where))
            stack.extend(reversed(children))
        elif isinstance(current, yaml.SequenceNode):
            stack.extend(reversed([(item, _join(path, i)) for i, item in enumerate(current.value)]))


def parse_yaml(text: str, file: str = "<text>") -> Any:
    """Parse YAML text safely, refusing a key repeated in one mapping; raises ``yaml.YAMLError`` on bad syntax."""
    loader = _yaml_loader()(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _check_duplicate_keys(node, file)
        return loader.construct_document(node)
    finally:
        loader.dispose()


def _is_json_lines(text: str) -> bool:
    """Whether ``text`` is JSON objects one a line (which YAML cannot read past the first)."""
    import json

    lines = [line for line in text.splitlines()[:3] if line.strip()]
    try:
        return len(lines) > 1 and all(isinstance(json.loads(line), dict) for line in lines)
    except ValueError:
        return False


def read_yaml(path: str | os.PathLike) -> Any:
    """Parse a YAML file safely; a syntax error or a repeated key becomes one located line."""
    import yaml

    path = Path(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise MalformedFileError(str(path), "", "no such file; check the path") from None
    except IsADirectoryError:
        raise MalformedFileError(str(path), "", "is a directory; give the YAML file inside it") from None
    except PermissionError:
        raise MalformedFileError(str(path), "", "cannot be read (permission denied); check its permissions") from None
    except OSError as exc:
        raise MalformedFileError(str(path), "", f"cannot be read ({exc.strerror or 'input/output error'}); "
                                                "check the path") from None
    if raw.startswith(b"PAR1"):
        raise MalformedFileError(str(path), "", "this is a Parquet file (a stage table or a case), not YAML; "
                                                "give the YAML file the command asks for")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise MalformedFileError(str(path), "", f"not UTF-8 text (byte 0x{raw[exc.start]:02x} at offset {exc.start}); "
                                                "give the YAML file the command asks for") from None
    try:
        return parse_yaml(text, str(path))
    except yaml.YAMLError as exc:
        if _is_json_lines(text):
            raise MalformedFileError(str(path), "", "this is a JSON-lines file (a journal.jsonl or a metrics log), not "
                                                    "YAML; give the YAML file the command asks for") from None
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise MalformedFileError(str(path), "", f"{where}not valid YAML ({problem}); fix the syntax") from None


def load_yaml(cls: type[T], path: str | os.PathLike, supported_version: int) -> T:
    """Read ``path`` as artifact ``cls``: safe YAML, the artifact's kind, schema version, full validation.

    A file that is another kind of rltune artifact (a diagnosis where candidates are expected) is
    refused as such before its fields are read (:func:`rltune.contracts.identity.check_kind`).
    """
    from rltune.contracts.identity import check_kind

    data = read_yaml(path)
    if not isinstance(data, dict):
        raise MalformedFileError(str(path), "", f"expected a YAML mapping at the top level, found {_describe(data)}")
    check_kind(data, str(path), cls)
    check_schema_version(data, str(path), supported_version)
    return from_data(cls, data, str(Path(path)))


def current_umask() -> int:
    """The process's umask (read from /proc where it can be, so no other thread sees it change)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def make_temp_file(directory: str | os.PathLike, name: str) -> tuple[int, str]:
    """``tempfile.mkstemp`` beside ``name``, with the permissions a plain ``open`` would give (the umask's).

    mkstemp makes files only their owner can read; a file moved into place from it would keep that.
    """
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{name}.", suffix=".tmp")
    os.fchmod(fd, 0o666 & ~current_umask())
    return fd, tmp


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to ``path`` so that a crash leaves either the old file or the new one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = make_temp_file(path.parent, path.name)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def dump_yaml(obj: Any, path: str | os.PathLike) -> None:
    """Write a schema object (or plain data) as YAML, atomically, keys in schema order."""
    import yaml

    atomic_write_text(path, yaml.safe_dump(to_data(obj), sort_keys=False, allow_unicode=True, width=100))


def _range_text(meta: Any) -> str:
    """', 1 to 10000' / ', >= 0' / ', <= 100' for a field with bounds, else ''."""
    lo, hi = meta.get("min"), meta.get("max")
    if lo is not None and hi is not None:
        return f", {_number(lo)} to {_number(hi)}"
    if lo is not None:
        return f", >= {_number(lo)}"
    if hi is not None:
        return f", <= {_number(hi)}"
    return ""


def field_docs(cls: type) -> list[tuple[str, str, str]]:
    """(dotted name, type and range, doc) for every field of ``cls`` and its nested dataclasses."""
    rows: list[tuple[str, str, str]] = []
    hints = get_type_hints(cls)

    def nested(tp: Any) -> Any:
        origin = get_origin(tp)
        if dataclasses.is_dataclass(tp):
            return tp
        if origin in (Union, types.UnionType):
            for arg in get_args(tp):
                found = nested(arg)
                if found:
                    return found
        if origin is list:
            return nested(get_args(tp)[0])
        if origin is dict:
            return nested(get_args(tp)[1])
        return None

    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        rows.append((f.name, _type_name(tp) + _range_text(f.metadata), f.metadata.get("doc", "")))
        sub = nested(tp)
        if sub is not None:
            suffix = "[]" if get_origin(tp) is list else ("{}" if get_origin(tp) is dict else "")
            for name, tname, doc in field_docs(sub):
                rows.append((f"{f.name}{suffix}.{name}", tname, doc))
    return rows


__all__ = [
    "FieldProblem",
    "atomic_write_text",
    "check_parquet_version",
    "check_schema_version",
    "dump_yaml",
    "field",
    "field_docs",
    "from_data",
    "load_yaml",
    "parse_yaml",
    "read_yaml",
    "to_data",
]
