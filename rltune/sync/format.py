"""Constants, exceptions and validated readers/writers of the delta-sync byte format.

docs/delta-format.md is the specification; this module is its executable form. Everything a reader
trusts passes through here: sizes are checked against caps *before* anything is allocated, every
CRC is checked, and every rule of the spec has one exception class.

Example::

    from rltune.sync import format as fmt
    header, payload_start = fmt.read_part_header(path, expect=dict(step=42, run_id="run", kind="delta"))
"""

from __future__ import annotations

import json
import os
import re
import struct
import zlib
from pathlib import Path
from typing import Any

from rltune.errors import RltuneError

FORMAT_VERSION = 1
MAGIC = b"RLTSYNC\0"
MAX_HEADER_BYTES = 16 << 20
MAX_MANIFEST_BYTES = 64 << 20
MAX_MARKER_BYTES = 4096
MAX_TENSOR_ELEMENTS = 1 << 40
ANCHOR_CRC_BLOCK = 1 << 20
STEP_DIR_DIGITS = 12
MANIFEST_NAME = "manifest.json"
COMPLETE_NAME = "COMPLETE"
KINDS = ("delta", "anchor", "full")
DTYPES = ("bfloat16", "float16", "float32", "float8_e4m3fn", "float8_e5m2")
PART_FILE_RE = re.compile(r"^rank-[0-9]{5}\.(delta|anchor)$")
_PREFIX = struct.Struct("<8sII")  # magic, format_version, header_len


class SyncFormatError(RltuneError):
    """Base of every rule of docs/delta-format.md a reader can find broken."""


class BadMagicError(SyncFormatError):
    """A part file does not start with the format's magic bytes."""


class FormatVersionError(SyncFormatError):
    """A file was written in a format version this reader does not implement."""


class HeaderTooLargeError(SyncFormatError):
    """A header, manifest or marker is larger than its cap."""


class TruncatedFileError(SyncFormatError):
    """A file is shorter or longer than its header or manifest says."""


class CorruptBytesError(SyncFormatError):
    """A CRC-32 over a header, stream, anchor block or manifest does not match."""


class ManifestSchemaError(SyncFormatError):
    """A manifest, marker or part header breaks the schema or a rule of the spec."""


class ManifestPathError(SyncFormatError):
    """A file named by a manifest would leave its step directory."""


class MissingPartError(SyncFormatError):
    """A part file the manifest lists does not exist."""


class WrongStepError(SyncFormatError):
    """A part file belongs to another step, run, kind or rank than its manifest."""


class CodecError(SyncFormatError):
    """A codec stream is structurally invalid."""


class ChainError(SyncFormatError):
    """A step needed to reach the target is missing/incomplete, or a delta's base is not the held step."""


class ChecksumMismatchError(SyncFormatError):
    """Tensors do not hold the values the trainer's checksums describe."""


class WeightChangedOutsideStepError(SyncFormatError):
    """A trainer weight changed outside the optimizer step, so a delta would miss that change."""


class UpdateFailedError(SyncFormatError):
    """The update failed on another worker of this TP group; every worker reloads next time."""


class IndexMapError(SyncFormatError):
    """The engine's checkpoint->parameter index map cannot be used (uneven cover, dtype, overlap)."""


def step_dir_name(step: int) -> str:
    return f"step-{step:0{STEP_DIR_DIGITS}d}"


def parse_step_dir_name(name: str) -> int | None:
    """Step number of a directory name, or None for anything that is not a step directory."""
    if len(name) == 5 + STEP_DIR_DIGITS and name.startswith("step-") and name[5:].isdigit():
        return int(name[5:])
    return None


def part_file_name(rank: int, kind: str) -> str:
    return f"rank-{rank:05d}.{'anchor' if kind == 'anchor' else 'delta'}"


def crc32(data: bytes | memoryview) -> int:
    return zlib.crc32(data) & 0xFFFFFFFF


def write_atomic(path: Path, data: bytes) -> None:
    """Write to a temporary name in the same directory, fsync, rename: readers see all or nothing."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_safetensors_atomic(state: dict, path: Path, metadata: dict[str, str]) -> None:
    """A full checkpoint as safetensors, written as :func:`write_atomic` does (streamed, not built in memory)."""
    from safetensors.torch import save_file

    tmp = path.with_suffix(".tmp")
    save_file(state, str(tmp), metadata=metadata)
    with open(tmp, "rb") as handle:
        os.fsync(handle.fileno())
    os.replace(tmp, path)


# ----------------------------------------------------------------------------------------------
# part files


def encode_part(header: dict[str, Any], payload: bytes) -> bytes:
    """Serialise a part file: prefix, JSON header, header CRC, payload."""
    header = dict(header, payload_len=len(payload))
    raw = json.dumps(header, separators=(",", ":"), allow_nan=False).encode()
    if len(raw) > MAX_HEADER_BYTES:
        raise HeaderTooLargeError(f"part header is {len(raw)} bytes, cap {MAX_HEADER_BYTES}: split the tensors over more ranks")
    return _PREFIX.pack(MAGIC, FORMAT_VERSION, len(raw)) + raw + struct.pack("<I", crc32(raw)) + payload


_DELTA_ENTRY_KEYS = {"name", "start", "stop", "offset", "length", "crc32", "changes"}
_ANCHOR_ENTRY_KEYS = {"name", "start", "stop", "offset", "length", "crc_block", "crc32s"}
_PART_KEYS = {"kind", "run_id", "step", "base_step", "rank", "world", "payload_len", "entries"}


def _is_int(v: Any, lo: int = 0, hi: int = 1 << 63) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi


def read_part_header(path: Path, expect: dict[str, Any] | None = None,
                     expect_bytes: int | None = None) -> tuple[dict[str, Any], int]:
    """Read and validate a part file's header; return (header, payload offset in the file).

    ``expect`` holds manifest fields (kind, run_id, step, base_step, rank, world) the header must
    equal; ``expect_bytes`` the file size the manifest records.
    """
    path = Path(path)
    try:
        size = path.stat().st_size
        f = open(path, "rb")
    except FileNotFoundError:
        raise MissingPartError(f"{path}: part file listed in the manifest is missing; the engine will reload from an anchor") from None
    with f:
        prefix = f.read(_PREFIX.size)
        if len(prefix) < _PREFIX.size:
            raise TruncatedFileError(f"{path}: {size} bytes, shorter than the 16-byte prefix")
        magic, version, header_len = _PREFIX.unpack(prefix)
        if magic != MAGIC:
            raise BadMagicError(f"{path}: magic {magic!r}, expected {MAGIC!r}: not a delta-sync part file")
        if version != FORMAT_VERSION:
            raise FormatVersionError(f"{path}: format_version {version}, this reader implements {FORMAT_VERSION}; upgrade rltune")
        if header_len == 0 or header_len > MAX_HEADER_BYTES:
            raise HeaderTooLargeError(f"{path}: header_len {header_len} outside 1..{MAX_HEADER_BYTES}")
        if _PREFIX.size + header_len + 4 > size:
            raise TruncatedFileError(f"{path}: {size} bytes, header needs {_PREFIX.size + header_len + 4}")
        raw = f.read(header_len)
        (want_crc,) = struct.unpack("<I", f.read(4))
    if crc32(raw) != want_crc:
        raise CorruptBytesError(f"{path}: header CRC-32 {crc32(raw):#010x} != stored {want_crc:#010x}")
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ManifestSchemaError(f"{path}: header is not JSON ({e})") from None
    payload_start = _PREFIX.size + header_len + 4
    _validate_part_header(path, header)
    if payload_start + header["payload_len"] != size:
        raise TruncatedFileError(f"{path}: {size} bytes, header says {payload_start + header['payload_len']}")
    if expect_bytes is not None and size != expect_bytes:
        raise TruncatedFileError(f"{path}: {size} bytes, manifest says {expect_bytes}")
    for key, want in (expect or {}).items():
        if header[key] != want:
            raise WrongStepError(f"{path}: header {key}={header[key]!r} but the manifest says {want!r}: "
                                 "a part from another step/run was copied in")
    return header, payload_start


def _validate_part_header(path: Path, h: Any) -> None:
    def bad(msg: str) -> ManifestSchemaError:
        return ManifestSchemaError(f"{path}: header: {msg}")

    if not isinstance(h, dict) or set(h) != _PART_KEYS:
        raise bad(f"keys must be exactly {sorted(_PART_KEYS)}")
    if h["kind"] not in ("delta", "anchor"):
        raise bad(f"kind {h['kind']!r} not delta/anchor")
    if not isinstance(h["run_id"], str) or not _is_int(h["step"]) or not _is_int(h["payload_len"]):
        raise bad("run_id/step/payload_len have wrong types")
    if h["base_step"] is not None and not _is_int(h["base_step"]):
        raise bad("base_step must be an integer or null")
    if not _is_int(h["world"], 1, 65536) or not _is_int(h["rank"], 0, h["world"] - 1):
        raise bad("rank/world out of range")
    if not isinstance(h["entries"], list):
        raise bad("entries must be a list")
    keys = _DELTA_ENTRY_KEYS if h["kind"] == "delta" else _ANCHOR_ENTRY_KEYS
    end = 0
    for e in h["entries"]:
        if not isinstance(e, dict) or set(e) != keys:
            raise bad(f"entry keys must be exactly {sorted(keys)}")
        if not isinstance(e["name"], str):
            raise bad("entry name must be a string")
        for k in ("start", "stop", "offset", "length"):
            if not _is_int(e[k], 0, 1 << 62):
                raise bad(f"entry {e['name']}: {k} must be a non-negative integer")
        if not e["start"] <= e["stop"] <= MAX_TENSOR_ELEMENTS:
            raise bad(f"entry {e['name']}: range [{e['start']}, {e['stop']}) invalid")
        if e["offset"] < end or e["offset"] + e["length"] > h["payload_len"]:
            raise bad(f"entry {e['name']}: bytes [{e['offset']}, {e['offset'] + e['length']}) overlap or leave the payload")
        end = e["offset"] + e["length"]
        if h["kind"] == "delta":
            if not _is_int(e["crc32"], 0, 0xFFFFFFFF) or not _is_int(e["changes"], 1, e["stop"] - e["start"]):
                raise bad(f"entry {e['name']}: crc32/changes out of range")
        else:
            if not _is_int(e["crc_block"], 1, 1 << 30) or not isinstance(e["crc32s"], list):
                raise bad(f"entry {e['name']}: crc_block/crc32s invalid")
            if len(e["crc32s"]) != -(-e["length"] // e["crc_block"]):
                raise bad(f"entry {e['name']}: {len(e['crc32s'])} block CRCs for {e['length']} bytes")


def read_entry_bytes(path: Path, payload_start: int, entry: dict[str, Any]) -> bytes:
    """Bytes of one delta entry, CRC-checked."""
    with open(path, "rb") as f:
        f.seek(payload_start + entry["offset"])
        data = f.read(entry["length"])
    if len(data) != entry["length"]:
        raise TruncatedFileError(f"{path}: entry {entry['name']} ends past the end of the file")
    if crc32(data) != entry["crc32"]:
        raise CorruptBytesError(f"{path}: entry {entry['name']}: CRC-32 mismatch (damaged bytes)")
    return data


def read_anchor_range(path: Path, payload_start: int, entry: dict[str, Any], lo_byte: int, hi_byte: int) -> bytes:
    """Bytes [lo_byte, hi_byte) of an anchor entry; every CRC block they touch is read and checked."""
    block = entry["crc_block"]
    b0, b1 = lo_byte // block, -(-hi_byte // block)
    start, stop = b0 * block, min(b1 * block, entry["length"])
    with open(path, "rb") as f:
        f.seek(payload_start + entry["offset"] + start)
        data = f.read(stop - start)
    if len(data) != stop - start:
        raise TruncatedFileError(f"{path}: anchor entry {entry['name']} ends past the end of the file")
    view = memoryview(data)
    for j in range(b0, b1):
        chunk = view[(j - b0) * block:(j - b0 + 1) * block]
        if crc32(chunk) != entry["crc32s"][j]:
            raise CorruptBytesError(f"{path}: anchor entry {entry['name']} block {j}: CRC-32 mismatch (damaged bytes)")
    return bytes(view[lo_byte - start:hi_byte - start])


# ----------------------------------------------------------------------------------------------
# manifest and completion marker

_MANIFEST_KEYS = {"format_version", "run_id", "step", "kind", "base_step", "world", "parts", "anchors", "tensors"}
_TENSOR_KEYS = {"dtype", "shape", "checksum", "tied_to"}


def validate_manifest(m: Any, where: str = "manifest.json") -> dict[str, Any]:
    """Check a parsed manifest against the schema and rules of docs/delta-format.md."""
    def bad(msg: str) -> ManifestSchemaError:
        return ManifestSchemaError(f"{where}: {msg}")

    if not isinstance(m, dict):
        raise bad("not a JSON object")
    if set(m) != _MANIFEST_KEYS:
        extra, missing = set(m) - _MANIFEST_KEYS, _MANIFEST_KEYS - set(m)
        raise bad(f"unknown keys {sorted(extra)} / missing keys {sorted(missing)}")
    if m["format_version"] != FORMAT_VERSION:
        raise FormatVersionError(f"{where}: format_version {m['format_version']!r}, this reader implements {FORMAT_VERSION}")
    if not isinstance(m["run_id"], str) or len(m["run_id"]) > 256:
        raise bad("run_id must be a string of at most 256 characters")
    if not _is_int(m["step"]) or m["kind"] not in KINDS or not _is_int(m["world"], 1, 65536):
        raise bad("step/kind/world invalid")
    full = m["kind"] == "full"
    if full != (m["base_step"] is None):
        raise bad("base_step must be null exactly for kind 'full'")
    if m["base_step"] is not None and not (_is_int(m["base_step"]) and m["base_step"] < m["step"]):
        raise bad("base_step must be an integer below step")
    for key, want_kind, needed in (("parts", "delta", not full), ("anchors", "anchor", m["kind"] != "delta")):
        files = m[key]
        if not isinstance(files, list):
            raise bad(f"{key} must be a list")
        for f in files:
            if not isinstance(f, dict) or set(f) != {"rank", "file", "bytes"}:
                raise bad(f"{key}: each item needs exactly rank, file, bytes")
            if not isinstance(f["file"], str) or not PART_FILE_RE.match(f["file"]):
                raise ManifestPathError(f"{where}: {key}: file {f['file']!r} is not a plain rank-NNNNN.(delta|anchor) "
                                        "name inside the step directory")
            if not f["file"].endswith("." + want_kind) or not _is_int(f["bytes"], 20) or not _is_int(f["rank"]):
                raise bad(f"{key}: {f['file']}: wrong suffix, rank or size")
        ranks = sorted(f["rank"] for f in files)
        if ranks != (list(range(m["world"])) if needed else []):
            raise bad(f"{key}: ranks {ranks} but kind {m['kind']} with world {m['world']} needs "
                      f"{list(range(m['world'])) if needed else []}")
    if not isinstance(m["tensors"], dict):
        raise bad("tensors must be an object")
    for name, t in m["tensors"].items():
        if not isinstance(t, dict) or set(t) != _TENSOR_KEYS:
            raise bad(f"tensors.{name}: keys must be exactly {sorted(_TENSOR_KEYS)}")
        if t["dtype"] not in DTYPES:
            raise bad(f"tensors.{name}.dtype {t['dtype']!r} not one of {DTYPES}")
        if not isinstance(t["shape"], list) or not all(_is_int(s) for s in t["shape"]):
            raise bad(f"tensors.{name}.shape must be a list of non-negative integers")
        numel = 1
        for s in t["shape"]:
            numel *= s
        if numel > MAX_TENSOR_ELEMENTS:
            raise bad(f"tensors.{name}: {numel} elements, cap {MAX_TENSOR_ELEMENTS}")
        if not isinstance(t["checksum"], str) or not re.fullmatch(r"[0-9]{1,20}", t["checksum"]) \
                or int(t["checksum"]) >= 1 << 64:
            raise bad(f"tensors.{name}.checksum must be a decimal u64 string")
        tied = t["tied_to"]
        if tied is not None:
            base = m["tensors"].get(tied)
            if base is None or base["tied_to"] is not None or base["dtype"] != t["dtype"] or base["shape"] != t["shape"]:
                raise bad(f"tensors.{name}.tied_to {tied!r} must name an untied tensor of the same dtype and shape")
    return m


def safe_child(step_dir: Path, name: str) -> Path:
    """A file of a step directory named by a manifest; refuses anything that would leave it."""
    if not PART_FILE_RE.match(name):
        raise ManifestPathError(f"{step_dir}: manifest names {name!r}, not a rank-NNNNN.(delta|anchor) file")
    path = (step_dir / name)
    resolved, root = path.resolve(), step_dir.resolve()
    if resolved.parent != root:
        raise ManifestPathError(f"{step_dir}: {name!r} resolves to {resolved}, outside the step directory")
    return path


def _read_capped(path: Path, cap: int) -> bytes:
    size = path.stat().st_size
    if size > cap:
        raise HeaderTooLargeError(f"{path}: {size} bytes, cap {cap}: not a file this format writes")
    with open(path, "rb") as f:
        return f.read(cap + 1)


def write_manifest(step_dir: Path, manifest: dict[str, Any]) -> None:
    """Write manifest.json and then the COMPLETE marker (last), both atomically."""
    validate_manifest(manifest, str(step_dir / MANIFEST_NAME))
    raw = json.dumps(manifest, separators=(",", ":"), allow_nan=False).encode()
    if len(raw) > MAX_MANIFEST_BYTES:
        raise HeaderTooLargeError(f"{step_dir}: manifest would be {len(raw)} bytes, cap {MAX_MANIFEST_BYTES}")
    write_atomic(step_dir / MANIFEST_NAME, raw)
    marker = {"format_version": FORMAT_VERSION, "step": manifest["step"], "manifest_bytes": len(raw),
              "manifest_crc32": crc32(raw)}
    write_atomic(step_dir / COMPLETE_NAME, json.dumps(marker).encode())


def read_manifest(step_dir: Path) -> dict[str, Any]:
    """The validated manifest of a complete step (checked against its COMPLETE marker)."""
    step_dir = Path(step_dir)
    marker_path = step_dir / COMPLETE_NAME
    try:
        marker_raw = _read_capped(marker_path, MAX_MARKER_BYTES)
    except FileNotFoundError:
        raise ChainError(f"{step_dir}: no {COMPLETE_NAME} marker; the step is not complete yet") from None
    try:
        marker = json.loads(marker_raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise ManifestSchemaError(f"{marker_path}: not JSON") from None
    if not isinstance(marker, dict) or set(marker) != {"format_version", "step", "manifest_bytes", "manifest_crc32"}:
        raise ManifestSchemaError(f"{marker_path}: keys must be format_version, step, manifest_bytes, manifest_crc32")
    if marker["format_version"] != FORMAT_VERSION:
        raise FormatVersionError(f"{marker_path}: format_version {marker['format_version']!r}")
    if not _is_int(marker["manifest_bytes"]) or marker["manifest_bytes"] > MAX_MANIFEST_BYTES:
        raise HeaderTooLargeError(f"{marker_path}: manifest_bytes {marker['manifest_bytes']!r} over cap {MAX_MANIFEST_BYTES}")
    raw = _read_capped(step_dir / MANIFEST_NAME, MAX_MANIFEST_BYTES)
    if len(raw) != marker["manifest_bytes"]:
        raise TruncatedFileError(f"{step_dir / MANIFEST_NAME}: {len(raw)} bytes, marker says {marker['manifest_bytes']}")
    if crc32(raw) != marker["manifest_crc32"]:
        raise CorruptBytesError(f"{step_dir / MANIFEST_NAME}: CRC-32 differs from the COMPLETE marker")
    try:
        manifest = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ManifestSchemaError(f"{step_dir / MANIFEST_NAME}: not JSON ({e})") from None
    validate_manifest(manifest, str(step_dir / MANIFEST_NAME))
    expected = parse_step_dir_name(step_dir.name)
    if manifest["step"] != expected or marker["step"] != expected:
        raise WrongStepError(f"{step_dir}: manifest step {manifest['step']} / marker step {marker['step']} "
                             f"but the directory is step {expected}")
    return manifest
