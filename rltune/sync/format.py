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
import stat
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rltune.errors import RltuneError

if TYPE_CHECKING:
    import torch

FORMAT_VERSION = 2
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
PART_FILE_RE = re.compile(r"^rank-[0-9]{5}\.(delta|anchor)$")
ATTEMPT_RE = re.compile(r"^[0-9a-f]{16,64}$")
CHECKSUM2_PRIME = (1 << 31) - 1
_V1_HINT = ("format version 1 has no second checksum and no attempt ids, so a reader cannot tell a republished "
            "or crashed step from the one it holds; this reader implements version 2 only: upgrade the trainer's "
            "rltune and let it publish a full checkpoint")
_PREFIX = struct.Struct("<8sII")  # magic, format_version, header_len


# ------------------------------------------------------------------------------------ element dtypes


@dataclass(frozen=True)
class WireDtype:
    """One element dtype the format carries: every other table of the sync path is read from these."""

    name: str  # the manifest's tensors.<name>.dtype, and torch's name for the dtype
    bits: int  # wire bits per element: a tensor's anchor bytes are its elements x bits / 8, little-endian
    nonfinite: int  # the exponent field: an element whose wire bits set all of it is inf or NaN


# float8_e4m3fn has no inf and one NaN pattern, S.1111.111: all seven bits below the sign.
WIRE_DTYPES: dict[str, WireDtype] = {d.name: d for d in (
    WireDtype("bfloat16", 16, 0x7F80),
    WireDtype("float16", 16, 0x7C00),
    WireDtype("float32", 32, 0x7F800000),
    WireDtype("float8_e4m3fn", 8, 0x7F),
    WireDtype("float8_e5m2", 8, 0x7C),
)}
DTYPES = tuple(WIRE_DTYPES)
# The integer that holds one element's wire bits, by width (the same name in numpy and torch): a
# signed view is read through wire_mask(bits) to its unsigned value.
BITS_INTEGERS = {8: "uint8", 16: "int16", 32: "int32"}


def wire_mask(bits: int) -> int:
    """The unsigned value of ``bits`` wire bits: ``2**bits - 1``."""
    return (1 << bits) - 1


def dtype_name(dtype: torch.dtype) -> str:
    """torch's name for a dtype without its module (``torch.bfloat16`` -> ``"bfloat16"``): a manifest's name."""
    return str(dtype).removeprefix("torch.")


def wire_dtype(dtype: Any) -> WireDtype | None:
    """The format's entry for a torch dtype, or None for anything the format does not carry (imports
    torch, as do the next: only the tensor-side modules call them)."""
    import torch

    return WIRE_DTYPES.get(dtype_name(dtype)) if isinstance(dtype, torch.dtype) else None


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a wire dtype's name."""
    import torch

    return getattr(torch, WIRE_DTYPES[name].name)


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


class StepNotReadyError(ChainError):
    """A step has no COMPLETE marker (yet): the trainer is still writing it, or never did. Nothing was
    changed; ask again later (``apply(step, wait_s=...)`` waits politely)."""


class MissingManifestError(SyncFormatError):
    """A step's COMPLETE marker exists but its manifest.json does not (or is not a file)."""


class AnchorCoverError(SyncFormatError):
    """A step's anchor slices do not cover a manifest tensor exactly once (missing, short, long or overlapping)."""


class ChecksumMismatchError(SyncFormatError):
    """Tensors do not hold the values the trainer's checksums describe."""


class WeightChangedOutsideStepError(SyncFormatError):
    """A trainer weight changed outside the optimizer step, so a delta would miss that change."""


class NonFiniteWeightsError(SyncFormatError):
    """Weights a publish would send are NaN or infinite; nothing of the step was written."""


class UpdateFailedError(SyncFormatError):
    """The update failed on another worker of this TP group; every worker reloads next time."""


class GroupUnreachableError(UpdateFailedError):
    """A collective of the TP group failed or timed out: a worker died or stopped answering."""


class InternalSyncError(SyncFormatError):
    """An exception rltune does not type escaped a read, apply or verify (a bug: report it); the
    update failed as any other and the engine reloads at its next update."""


class IndexMapError(SyncFormatError):
    """The engine's checkpoint->parameter index map cannot be used (uneven cover, dtype, overlap)."""


class LayoutMovedError(IndexMapError):
    """At the first update the engine does not hold its boot checkpoint where the index map says, and a
    moved block is found nowhere else in its parameter (or in more than one place): the engine moved
    weights after loading in a way the map cannot follow."""


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


def _no_constants(name: str):
    raise ValueError(f"{name} is not JSON this format allows")


def parse_json(raw: bytes, where: str, what: str = "file") -> Any:
    """Strict JSON of a format file: UTF-8, no NaN/Infinity, bounded nesting; any failure is a
    :class:`ManifestSchemaError` naming the file."""
    try:
        return json.loads(raw, parse_constant=_no_constants)
    except (UnicodeDecodeError, json.JSONDecodeError, ValueError) as e:
        raise ManifestSchemaError(f"{where}: {what} is not valid JSON ({e}); the file is damaged: the trainer "
                                  "rewrites it when it republishes the step") from None
    except RecursionError:
        raise ManifestSchemaError(f"{where}: {what} nests deeper than any file this format writes; refused") from None


def _file_kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a named pipe"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "a device"


def open_regular(path: Path, what: str, missing: type[SyncFormatError]):
    """open(path, 'rb') of a regular file, never blocking: a directory, named pipe, socket or device in
    its place is ``missing`` (a reader that opened a pipe would wait for a writer forever), as is any
    OS failure; the message names the file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise missing(f"{path}: {what} is absent") from None
    except OSError as e:
        raise missing(f"{path}: {what} cannot be read ({type(e).__name__}: {e}); check the broadcast root's "
                      "storage") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise missing(f"{path}: {what} is {_file_kind(mode)}, not a file; refused: the step is damaged")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _open_part(path: Path, what: str):
    """open(path, 'rb') of a part file with every OS failure as a typed error naming the file."""
    try:
        return open_regular(path, what, MissingPartError)
    except MissingPartError as e:
        if "is absent" not in str(e):
            raise MissingPartError(f"{e}; the engine keeps its weights and reloads once the trainer rewrites the "
                                   "step") from None
        raise MissingPartError(f"{path}: {what} listed in the manifest is missing (pruned or never written); the engine "
                               "will reload from an anchor") from None


def write_atomic(path: Path, data: bytes | memoryview | list[bytes | memoryview]) -> None:
    """Write to a temporary name in the same directory, fsync, rename: readers see all or nothing."""
    os.replace(write_temporary(path, data), path)


def write_temporary(path: Path, data: bytes | memoryview | list[bytes | memoryview]) -> Path:
    """The first half of :func:`write_atomic`: ``data`` (a buffer, or buffers written one after the other)
    written and fsync'd under the temporary name of ``path`` (returned); renaming it to ``path`` publishes
    it."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        if isinstance(data, list):
            f.writelines(data)
        else:
            f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return tmp


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
    return b"".join(part_chunks(header, [payload]))


def part_chunks(header: dict[str, Any], payload: list[bytes | memoryview]) -> list[bytes | memoryview]:
    """A part file as buffers to write one after the other: prefix, JSON header and header CRC in the first,
    then the payload's pieces as they are (an anchor's 150 MB joined twice cost more than its CRCs)."""
    header = dict(header, payload_len=chunks_size(payload))
    raw = json.dumps(header, separators=(",", ":"), allow_nan=False).encode()
    if len(raw) > MAX_HEADER_BYTES:
        raise HeaderTooLargeError(f"part header is {len(raw)} bytes, cap {MAX_HEADER_BYTES}: split the tensors over more ranks")
    return [_PREFIX.pack(MAGIC, FORMAT_VERSION, len(raw)) + raw + struct.pack("<I", crc32(raw)), *payload]


def chunks_size(chunks: bytes | memoryview | list[bytes | memoryview]) -> int:
    """Bytes in a buffer, or in a list of buffers written one after the other."""
    if isinstance(chunks, list):
        return sum(memoryview(c).nbytes for c in chunks)
    return memoryview(chunks).nbytes


_DELTA_ENTRY_KEYS = {"name", "start", "stop", "offset", "length", "crc32", "changes"}
_ANCHOR_ENTRY_KEYS = {"name", "start", "stop", "offset", "length", "crc_block", "crc32s"}
_PART_KEYS = {"kind", "run_id", "attempt", "step", "base_step", "rank", "world", "payload_len", "entries"}


def _is_int(v: Any, lo: int = 0, hi: int = 1 << 63) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi


def read_part_header(path: Path, expect: dict[str, Any] | None = None,
                     expect_bytes: int | None = None) -> tuple[dict[str, Any], int]:
    """Read and validate a part file's header; return (header, payload offset in the file).

    ``expect`` holds manifest fields (kind, run_id, step, base_step, rank, world) the header must
    equal; ``expect_bytes`` the file size the manifest records.
    """
    path = Path(path)
    f = _open_part(path, "part file")
    with f:
        size = os.fstat(f.fileno()).st_size
        prefix = f.read(_PREFIX.size)
        if len(prefix) < _PREFIX.size:
            raise TruncatedFileError(f"{path}: {size} bytes, shorter than the 16-byte prefix")
        magic, version, header_len = _PREFIX.unpack(prefix)
        if magic != MAGIC:
            raise BadMagicError(f"{path}: magic {magic!r}, expected {MAGIC!r}: not a delta-sync part file")
        if version != FORMAT_VERSION:
            hint = _V1_HINT if version == 1 else "upgrade rltune"
            raise FormatVersionError(f"{path}: format_version {version}, this reader implements {FORMAT_VERSION}; {hint}")
        if header_len == 0 or header_len > MAX_HEADER_BYTES:
            raise HeaderTooLargeError(f"{path}: header_len {header_len} outside 1..{MAX_HEADER_BYTES}")
        if _PREFIX.size + header_len + 4 > size:
            raise TruncatedFileError(f"{path}: {size} bytes, header needs {_PREFIX.size + header_len + 4}")
        raw = f.read(header_len)
        (want_crc,) = struct.unpack("<I", f.read(4))
    if crc32(raw) != want_crc:
        raise CorruptBytesError(f"{path}: header CRC-32 {crc32(raw):#010x} != stored {want_crc:#010x}")
    header = parse_json(raw, str(path), "header")
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
    if not isinstance(h["attempt"], str) or not ATTEMPT_RE.match(h["attempt"]):
        raise bad("attempt must be 16-64 lowercase hex digits")
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
    return bytes(read_entries_bytes(path, payload_start, [entry])[0])


_ENTRY_READ_GAP = 1 << 20  # entries closer than this are read together, the bytes between them too


def read_entries_bytes(path: Path, payload_start: int, entries: list[dict[str, Any]]) -> list[memoryview]:
    """Bytes of several delta entries of one part (in the order given), each CRC-checked, read a span at a
    time: entries less than 1 MiB apart in one read (a read per entry cost more than the reads themselves
    at ~100 entries a step), so a worker that holds few of a part's entries reads little else."""
    spans: list[tuple[int, int, list[int]]] = []  # (first byte, end, entries) of each read
    for k in sorted(range(len(entries)), key=lambda k: entries[k]["offset"]):
        e = entries[k]
        if spans and e["offset"] - spans[-1][1] <= _ENTRY_READ_GAP:
            lo, hi, members = spans[-1]
            spans[-1] = (lo, max(hi, e["offset"] + e["length"]), [*members, k])
        else:
            spans.append((e["offset"], e["offset"] + e["length"], [k]))
    out: list[memoryview | None] = [None] * len(entries)
    if not spans:
        return []
    with _open_part(Path(path), "part file") as f:
        for lo, hi, span in spans:
            f.seek(payload_start + lo)
            view = memoryview(f.read(hi - lo))
            for k in span:
                e = entries[k]
                data = view[e["offset"] - lo:e["offset"] - lo + e["length"]]
                if len(data) != e["length"]:
                    raise TruncatedFileError(f"{path}: entry {e['name']} ends past the end of the file")
                if crc32(data) != e["crc32"]:
                    raise CorruptBytesError(f"{path}: entry {e['name']}: CRC-32 mismatch (damaged bytes)")
                out[k] = data
    return out


def read_anchor_range(path: Path, payload_start: int, entry: dict[str, Any], lo_byte: int, hi_byte: int) -> bytes:
    """Bytes [lo_byte, hi_byte) of an anchor entry; every CRC block they touch is read and checked."""
    block = entry["crc_block"]
    b0, b1 = lo_byte // block, -(-hi_byte // block)
    start, stop = b0 * block, min(b1 * block, entry["length"])
    with _open_part(Path(path), "anchor file") as f:
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

_MANIFEST_KEYS = {"format_version", "run_id", "attempt", "step", "kind", "base_step", "base_attempt", "world", "parts",
                  "anchors", "tensors"}
_TENSOR_KEYS = {"dtype", "shape", "checksum", "checksum2", "tied_to"}
_MARKER_KEYS = {"format_version", "step", "attempt", "manifest_bytes", "manifest_crc32"}


def _u64_string(v: Any) -> bool:
    return isinstance(v, str) and re.fullmatch(r"[0-9]{1,20}", v) is not None and int(v) < 1 << 64


def validate_manifest(m: Any, where: str = "manifest.json") -> dict[str, Any]:
    """Check a parsed manifest against the schema and rules of docs/delta-format.md.

    Every violation is a :class:`ManifestSchemaError` (or the error of its own rule) whose message
    names the file and the field; no value of any JSON type makes it raise anything else.
    """
    def bad(field: str, msg: str) -> ManifestSchemaError:
        return ManifestSchemaError(f"{where}: {field}: {msg}; the manifest is damaged or not written by rltune: the "
                                   "trainer rewrites it when it republishes the step")

    if not isinstance(m, dict):
        raise bad("(top level)", "not a JSON object")
    if "format_version" in m and m["format_version"] != FORMAT_VERSION:
        if m["format_version"] == 1:
            raise FormatVersionError(f"{where}: format_version 1; {_V1_HINT}")
        raise FormatVersionError(f"{where}: format_version {m['format_version']!r}, this reader implements "
                                 f"{FORMAT_VERSION}; upgrade rltune")
    if set(m) != _MANIFEST_KEYS:
        extra, missing = set(m) - _MANIFEST_KEYS, _MANIFEST_KEYS - set(m)
        raise bad("(keys)", f"unknown keys {sorted(extra)} / missing keys {sorted(missing)}")
    if not isinstance(m["run_id"], str) or len(m["run_id"]) > 256:
        raise bad("run_id", "must be a string of at most 256 characters")
    for key in ("step", "world"):
        if not _is_int(m[key], 0 if key == "step" else 1, (1 << 63) if key == "step" else 65536):
            raise bad(key, f"{m[key]!r} is not an integer in range")
    if not isinstance(m["kind"], str) or m["kind"] not in KINDS:
        raise bad("kind", f"{m['kind']!r} is not one of {KINDS}")
    if not isinstance(m["attempt"], str) or not ATTEMPT_RE.match(m["attempt"]):
        raise bad("attempt", "must be 16-64 lowercase hex digits")
    full = m["kind"] == "full"
    if full != (m["base_step"] is None) or full != (m["base_attempt"] is None):
        raise bad("base_step", "base_step and base_attempt must be null exactly for kind 'full'")
    if m["base_step"] is not None and not (_is_int(m["base_step"]) and m["base_step"] < m["step"]):
        raise bad("base_step", "must be an integer below step")
    if m["base_attempt"] is not None and (not isinstance(m["base_attempt"], str)
                                          or not ATTEMPT_RE.match(m["base_attempt"])):
        raise bad("base_attempt", "must be 16-64 lowercase hex digits")
    for key, want_kind, needed in (("parts", "delta", not full), ("anchors", "anchor", m["kind"] != "delta")):
        files = m[key]
        if not isinstance(files, list):
            raise bad(key, "must be a list")
        for j, f in enumerate(files):
            if not isinstance(f, dict) or set(f) != {"rank", "file", "bytes"}:
                raise bad(f"{key}[{j}]", "each item needs exactly rank, file, bytes")
            if not isinstance(f["file"], str) or not PART_FILE_RE.match(f["file"]):
                raise ManifestPathError(f"{where}: {key}[{j}].file: {f['file']!r} is not a plain rank-NNNNN.(delta|anchor) "
                                        "name inside the step directory; refused")
            if not f["file"].endswith("." + want_kind):
                raise bad(f"{key}[{j}].file", f"{f['file']}: a {key} file must end in .{want_kind}")
            if not _is_int(f["bytes"], 20):
                raise bad(f"{key}[{j}].bytes", f"{str(f['bytes'])[:40]} is not a size of at least 20 bytes")
            if not _is_int(f["rank"], 0, 65535):
                raise bad(f"{key}[{j}].rank", f"{str(f['rank'])[:40]} is not a rank")
            if f["file"] != f"rank-{f['rank']:05d}.{want_kind}":
                raise bad(f"{key}[{j}].file", f"{f['file']} does not name rank {f['rank']}")
        ranks = sorted(f["rank"] for f in files)
        if ranks != (list(range(m["world"])) if needed else []):
            raise bad(key, f"ranks {ranks} but kind {m['kind']} with world {m['world']} needs "
                      f"{list(range(m['world'])) if needed else []}")
    if not isinstance(m["tensors"], dict):
        raise bad("tensors", "must be an object")
    for name, t in m["tensors"].items():
        field = f"tensors.{name}"
        if not isinstance(t, dict) or set(t) != _TENSOR_KEYS:
            raise bad(field, f"keys must be exactly {sorted(_TENSOR_KEYS)}")
        if not isinstance(t["dtype"], str) or t["dtype"] not in DTYPES:
            raise bad(f"{field}.dtype", f"{t['dtype']!r} not one of {DTYPES}")
        if not isinstance(t["shape"], list) or len(t["shape"]) > 8 or not all(_is_int(d, 1) for d in t["shape"]):
            raise bad(f"{field}.shape", f"{str(t['shape'])[:80]} is not a list of at most 8 positive integers "
                      "(a zero-size tensor has nothing to sync)")
        numel = 1
        for d in t["shape"]:
            numel *= d
        if numel > MAX_TENSOR_ELEMENTS:
            raise bad(f"{field}.shape", f"{numel} elements, cap {MAX_TENSOR_ELEMENTS}")
        if not _u64_string(t["checksum"]):
            raise bad(f"{field}.checksum", "must be a decimal u64 string")
        if not _u64_string(t["checksum2"]) or (int(t["checksum2"]) >> 32) >= CHECKSUM2_PRIME \
                or (int(t["checksum2"]) & 0xFFFFFFFF) >= CHECKSUM2_PRIME:
            raise bad(f"{field}.checksum2", "must be a decimal u64 string whose two 32-bit halves are below 2^31 - 1")
        if t["tied_to"] is not None and not isinstance(t["tied_to"], str):
            raise bad(f"{field}.tied_to", f"{str(t['tied_to'])[:80]} is neither null nor a tensor name")
    for name, t in m["tensors"].items():
        tied = t["tied_to"]
        if tied is not None:
            base = m["tensors"].get(tied)
            if base is None or base["tied_to"] is not None or base["dtype"] != t["dtype"] or base["shape"] != t["shape"]:
                raise bad(f"tensors.{name}.tied_to", f"{tied!r} must name an untied tensor of the same dtype and shape")
    return m


def numel_of(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def check_part_entries(path: Path, header: dict[str, Any], manifest: dict[str, Any]) -> None:
    """Entries of a part against its manifest: every name a manifest tensor (a delta never under a
    tied name), ranges inside the tensor, anchor entries exactly ``(stop - start) * itemsize`` bytes."""
    def bad(j: int, e: dict, field: str, msg: str) -> ManifestSchemaError:
        return ManifestSchemaError(f"{path}: step {manifest['step']}: entries[{j}] ({e.get('name')!r}).{field}: {msg}; "
                                   "the part is damaged: the engine keeps its weights until the trainer rewrites it")

    for j, e in enumerate(header["entries"]):
        t = manifest["tensors"].get(e["name"])
        if t is None or (header["kind"] == "delta" and t["tied_to"] is not None):
            raise bad(j, e, "name", "not a manifest tensor this part may carry")
        numel = numel_of(t["shape"])
        if e["stop"] > numel:
            raise bad(j, e, "stop", f"{e['stop']} > the tensor's {numel} elements")
        if header["kind"] == "anchor":
            want = (e["stop"] - e["start"]) * WIRE_DTYPES[t["dtype"]].bits // 8
            if e["length"] != want:
                raise AnchorCoverError(f"{path}: step {manifest['step']}: entries[{j}] ({e['name']!r}).length: "
                                       f"{e['length']} bytes, elements [{e['start']}, {e['stop']}) of "
                                       f"{t['dtype']} need {want} (a short or long anchor entry); the engine keeps "
                                       "its weights and falls back to an older anchor")


def check_cover(step_dir: Path, manifest: dict[str, Any], headers: list[tuple[Path, dict[str, Any]]]) -> None:
    """Across the parts of one kind of a step: anchor entries tile every manifest tensor exactly, and
    no two delta entries of a tensor overlap (a change applied twice)."""
    by_name: dict[str, list[tuple[int, int, Path]]] = {}
    kind = headers[0][1]["kind"] if headers else None
    for path, header in headers:
        for e in header["entries"]:
            by_name.setdefault(e["name"], []).append((e["start"], e["stop"], path))
    names = manifest["tensors"] if kind == "anchor" else by_name
    for name in names:
        ranges = sorted(by_name.get(name, []), key=lambda r: (r[0], r[1]))
        at = 0
        for start, stop, path in ranges:
            if start < at:
                cls = AnchorCoverError if kind == "anchor" else ManifestSchemaError
                raise cls(f"{path}: step {manifest['step']}: {name}: entry [{start}, {stop}) overlaps another entry "
                          f"ending at {at} (a change would be applied twice); the step is damaged")
            if kind == "anchor" and start != at:
                break
            at = stop
        if kind == "anchor" and at != numel_of(manifest["tensors"][name]["shape"]):
            files = sorted({p.name for _, _, p in ranges}) or ["(no anchor entry)"]
            raise AnchorCoverError(f"{step_dir}: step {manifest['step']}: the anchor slices of {name} ({', '.join(files)}) "
                                   f"cover [0, {at}) without gaps, not its "
                                   f"{numel_of(manifest['tensors'][name]['shape'])} elements; the engine keeps its "
                                   "weights and falls back to an older anchor")


def safe_child(step_dir: Path, name: str) -> Path:
    """A file of a step directory named by a manifest; refuses anything that would leave it."""
    if not isinstance(name, str) or not PART_FILE_RE.match(name):
        raise ManifestPathError(f"{step_dir}: manifest names {name!r}, not a rank-NNNNN.(delta|anchor) file")
    path = (step_dir / name)
    try:
        resolved, root = path.resolve(), step_dir.resolve()
    except (OSError, RuntimeError) as e:  # a symlink loop
        raise ManifestPathError(f"{step_dir}: {name!r} does not resolve ({e}); refused") from None
    if resolved.parent != root:
        raise ManifestPathError(f"{step_dir}: {name!r} resolves to {resolved}, outside the step directory")
    return path


def _read_capped(path: Path, cap: int, missing: type[SyncFormatError], what: str) -> bytes:
    inside(path)
    with open_regular(path, what, missing) as f:
        size = os.fstat(f.fileno()).st_size
        if size > cap:
            raise HeaderTooLargeError(f"{path}: {size} bytes, cap {cap}: not a file this format writes")
        try:
            return f.read(cap + 1)
        except OSError as e:
            raise missing(f"{path}: {what} cannot be read ({type(e).__name__}: {e})") from None


def inside(path: Path) -> Path:
    """A step's manifest or marker, refused (:class:`ManifestPathError`) if it is a link that resolves
    outside its step directory: a reader opens nothing of a step outside the step's own directory."""
    try:
        resolved, parent = path.resolve(), path.parent.resolve()
    except (OSError, RuntimeError) as e:  # a symlink loop
        raise ManifestPathError(f"{path}: does not resolve ({e}); refused") from None
    if resolved.parent != parent:
        raise ManifestPathError(f"{path}: resolves to {resolved}, outside the step directory {parent}; refused")
    return path


def marker_bytes(manifest_raw: bytes, manifest: dict[str, Any]) -> bytes:
    marker = {"format_version": FORMAT_VERSION, "step": manifest["step"], "attempt": manifest["attempt"],
              "manifest_bytes": len(manifest_raw), "manifest_crc32": crc32(manifest_raw)}
    return json.dumps(marker).encode()


def write_manifest(step_dir: Path, manifest: dict[str, Any]) -> None:
    """Write manifest.json and then the COMPLETE marker (last), both atomically."""
    validate_manifest(manifest, str(step_dir / MANIFEST_NAME))
    raw = json.dumps(manifest, separators=(",", ":"), allow_nan=False).encode()
    if len(raw) > MAX_MANIFEST_BYTES:
        raise HeaderTooLargeError(f"{step_dir}: manifest would be {len(raw)} bytes, cap {MAX_MANIFEST_BYTES}")
    write_atomic(step_dir / MANIFEST_NAME, raw)
    write_atomic(step_dir / COMPLETE_NAME, marker_bytes(raw, manifest))


def read_marker(step_dir: Path) -> tuple[bytes, dict[str, Any]]:
    """A step's COMPLETE marker: its raw bytes (what a reader caches a manifest under) and its fields.

    No marker is :class:`StepNotReadyError`: the step is still being written (or was pruned).
    """
    step_dir = Path(step_dir)
    marker_path = step_dir / COMPLETE_NAME
    raw = _read_capped(marker_path, MAX_MARKER_BYTES, StepNotReadyError, f"the {COMPLETE_NAME} marker (step not complete)")
    marker = parse_json(raw, str(marker_path), "marker")
    if isinstance(marker, dict) and "format_version" in marker and marker["format_version"] != FORMAT_VERSION:
        hint = _V1_HINT if marker["format_version"] == 1 else "upgrade rltune"
        raise FormatVersionError(f"{marker_path}: format_version {marker['format_version']!r}; {hint}")
    if not isinstance(marker, dict) or set(marker) != _MARKER_KEYS:
        raise ManifestSchemaError(f"{marker_path}: keys must be exactly {sorted(_MARKER_KEYS)}; the marker is damaged")
    if not _is_int(marker["manifest_bytes"]) or marker["manifest_bytes"] > MAX_MANIFEST_BYTES:
        raise HeaderTooLargeError(f"{marker_path}: manifest_bytes {marker['manifest_bytes']!r} over cap {MAX_MANIFEST_BYTES}")
    if not _is_int(marker["manifest_crc32"], 0, 0xFFFFFFFF) or not _is_int(marker["step"]) \
            or not isinstance(marker["attempt"], str) or not ATTEMPT_RE.match(marker["attempt"]):
        raise ManifestSchemaError(f"{marker_path}: manifest_crc32, step or attempt has the wrong type; the marker is damaged")
    return raw, marker


def read_manifest(step_dir: Path, marker: dict[str, Any] | None = None) -> dict[str, Any]:
    """The validated manifest of a complete step (checked against its COMPLETE marker, read here
    unless given)."""
    step_dir = Path(step_dir)
    if marker is None:
        _, marker = read_marker(step_dir)
    path = step_dir / MANIFEST_NAME
    raw = _read_capped(path, MAX_MANIFEST_BYTES, MissingManifestError,
                       f"{MANIFEST_NAME} under a {COMPLETE_NAME} marker (the step is damaged: the trainer rewrites it "
                       "when it republishes the step)")
    if len(raw) != marker["manifest_bytes"]:
        raise TruncatedFileError(f"{path}: {len(raw)} bytes, marker says {marker['manifest_bytes']}")
    if crc32(raw) != marker["manifest_crc32"]:
        raise CorruptBytesError(f"{path}: CRC-32 differs from the COMPLETE marker")
    manifest = validate_manifest(parse_json(raw, str(path), "manifest"), str(path))
    expected = parse_step_dir_name(step_dir.name)
    if manifest["step"] != expected or marker["step"] != expected:
        raise WrongStepError(f"{step_dir}: manifest step {manifest['step']} / marker step {marker['step']} "
                             f"but the directory is step {expected}")
    if manifest["attempt"] != marker["attempt"]:
        raise WrongStepError(f"{path}: attempt {manifest['attempt']} but the {COMPLETE_NAME} marker says "
                             f"{marker['attempt']}: a manifest of another publish of step {expected}")
    return manifest
