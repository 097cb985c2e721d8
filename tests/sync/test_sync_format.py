"""Format rules: manifest schema, path confinement, caps, magic/version, truncation, golden bytes."""

from __future__ import annotations

import copy
import json
import os
import struct

import pytest

from rltune.sync import format as fmt

A4, A3 = "a4" * 8, "a3" * 8  # attempt ids: 16 hex digits


def _manifest(**over):
    m = dict(format_version=2, run_id="r", attempt=A4, step=4, kind="delta", base_step=3, base_attempt=A3, world=1,
             parts=[dict(rank=0, file="rank-00000.delta", bytes=100)], anchors=[],
             tensors={"w": dict(dtype="bfloat16", shape=[2, 3], checksum="12", checksum2="34", tied_to=None),
                      "w2": dict(dtype="bfloat16", shape=[2, 3], checksum="12", checksum2="34", tied_to="w")})
    m.update(over)
    return m


def test_a_valid_manifest_round_trips_through_marker(tmp_path):
    d = tmp_path / fmt.step_dir_name(4)
    d.mkdir()
    fmt.write_manifest(d, _manifest())
    assert fmt.read_manifest(d) == _manifest()
    assert json.loads((d / fmt.COMPLETE_NAME).read_text())["step"] == 4


@pytest.mark.parametrize("mutate, error", [
    (lambda m: m.update(extra=1), fmt.ManifestSchemaError),
    (lambda m: m.update(kind="full"), fmt.ManifestSchemaError),          # full needs base_step null
    (lambda m: m.update(base_step=4), fmt.ManifestSchemaError),
    (lambda m: m.update(parts=[]), fmt.ManifestSchemaError),             # a delta needs every rank's part
    (lambda m: m["tensors"]["w"].update(checksum=str(2**64)), fmt.ManifestSchemaError),
    (lambda m: m["tensors"]["w"].update(dtype="int64"), fmt.ManifestSchemaError),
    (lambda m: m["tensors"]["w2"].update(tied_to="nope"), fmt.ManifestSchemaError),
    (lambda m: m["tensors"]["w"].update(shape=[2**21, 2**20]), fmt.ManifestSchemaError),
    (lambda m: m.update(format_version=3), fmt.FormatVersionError),
    (lambda m: m.update(format_version=1), fmt.FormatVersionError),
    (lambda m: m.update(base_attempt=None), fmt.ManifestSchemaError),    # a delta names its base's attempt
    (lambda m: m.update(attempt="not-hex"), fmt.ManifestSchemaError),
    (lambda m: m["tensors"]["w"].update(checksum2=str(((1 << 31) - 1) << 32)), fmt.ManifestSchemaError),
    (lambda m: m["tensors"]["w"].update(shape=[2, 0]), fmt.ManifestSchemaError),  # zero-size
    (lambda m: [t.update(shape=[]) for t in m["tensors"].values()], None),          # a scalar is fine
    (lambda m: m["parts"][0].update(file="rank-00001.delta"), fmt.ManifestSchemaError),  # names another rank
    (lambda m: m["parts"][0].update(file="../../etc/passwd"), fmt.ManifestPathError),
    (lambda m: m["parts"][0].update(file="/abs/rank-00000.delta"), fmt.ManifestPathError),
])
def test_manifest_rule_violations_raise_their_own_error(mutate, error):
    m = copy.deepcopy(_manifest())
    mutate(m)
    if error is None:
        fmt.validate_manifest(m)
        return
    with pytest.raises(error):
        fmt.validate_manifest(m)


_WRONG_TYPES = [[], {}, ["x"], {"a": 1}, 1.5, True, None, "7"]
_FIELDS = [("run_id",), ("attempt",), ("step",), ("kind",), ("base_step",), ("base_attempt",), ("world",), ("parts",),
           ("anchors",), ("tensors",), ("parts", 0), ("parts", 0, "rank"), ("parts", 0, "file"), ("parts", 0, "bytes"),
           ("tensors", "w"), ("tensors", "w", "dtype"), ("tensors", "w", "shape"), ("tensors", "w", "checksum"),
           ("tensors", "w", "checksum2"), ("tensors", "w2", "tied_to")]


@pytest.mark.parametrize("path", _FIELDS, ids=[".".join(map(str, f)) for f in _FIELDS])
def test_any_json_value_in_any_manifest_field_is_a_typed_error_naming_the_field(path):
    # lists and objects where strings belong, strings where numbers do: never a raw TypeError/KeyError
    for value in _WRONG_TYPES:
        m = copy.deepcopy(_manifest())
        parent = m
        for key in path[:-1]:
            parent = parent[key]
        legit = {("run_id", "7"), ("tensors", "{}"), ("tied_to", "None"), ("checksum", "'7'"), ("checksum2", "'7'")}
        if parent[path[-1]] == value or (str(path[-1]), repr(value) if isinstance(value, str) and path[-1] != "run_id"
                                         else str(value)) in legit:
            continue
        parent[path[-1]] = value
        try:
            fmt.validate_manifest(m, "step-000000000004/manifest.json")
        except fmt.SyncFormatError as e:
            assert "manifest.json" in str(e) and str(path[-1] if path[-1] != 0 else path[0]) in str(e), (path, value, e)
        else:
            pytest.fail(f"{path} = {value!r} was accepted")


def test_json_that_nests_too_deep_or_holds_nan_is_a_typed_error(tmp_path):
    with pytest.raises(fmt.ManifestSchemaError, match="nests deeper"):
        fmt.parse_json(b"[" * 100_000 + b"]" * 100_000, "m.json")
    with pytest.raises(fmt.ManifestSchemaError, match="not valid JSON"):
        fmt.parse_json(b'{"step": NaN}', "m.json")
    with pytest.raises(fmt.ManifestSchemaError, match="not valid JSON"):
        fmt.parse_json(b"\xff\xfe", "m.json")


def test_a_marker_without_its_manifest_or_with_a_directory_there_is_typed(tmp_path):
    d = tmp_path / fmt.step_dir_name(4)
    d.mkdir()
    fmt.write_manifest(d, _manifest())
    (d / fmt.MANIFEST_NAME).unlink()
    with pytest.raises(fmt.MissingManifestError, match="step-000000000004/manifest.json"):
        fmt.read_manifest(d)
    (d / fmt.MANIFEST_NAME).mkdir()
    with pytest.raises(fmt.MissingManifestError, match="is a directory"):
        fmt.read_manifest(d)
    (d / fmt.COMPLETE_NAME).unlink()
    with pytest.raises(fmt.StepNotReadyError):
        fmt.read_marker(d)


def test_version_1_files_are_refused_with_the_reason_and_the_fix(tmp_path):
    d = tmp_path / fmt.step_dir_name(4)
    d.mkdir()
    (d / fmt.COMPLETE_NAME).write_text(json.dumps(dict(format_version=1, step=4, manifest_bytes=10, manifest_crc32=0)))
    with pytest.raises(fmt.FormatVersionError, match="no second checksum.*full checkpoint"):
        fmt.read_marker(d)
    path = _part(tmp_path)
    raw = bytearray(path.read_bytes())
    raw[8:12] = struct.pack("<I", 1)
    path.write_bytes(bytes(raw))
    with pytest.raises(fmt.FormatVersionError, match="no second checksum"):
        fmt.read_part_header(path)


def test_a_link_leaving_the_step_directory_is_refused(tmp_path):
    outside = tmp_path / "secret"
    outside.write_bytes(b"x")
    d = tmp_path / "step"
    d.mkdir()
    os.symlink(outside, d / "rank-00000.delta")
    with pytest.raises(fmt.ManifestPathError):
        fmt.safe_child(d, "rank-00000.delta")
    (d / "rank-00001.delta").write_bytes(b"y")
    assert fmt.safe_child(d, "rank-00001.delta") == d / "rank-00001.delta"


def _part(tmp_path, header=None, payload=b"abcd"):
    h = header or dict(kind="delta", run_id="r", attempt=A4, step=4, base_step=3, rank=0, world=1,
                       entries=[dict(name="w", start=0, stop=6, offset=0, length=4, crc32=fmt.crc32(payload), changes=2)])
    path = tmp_path / "rank-00000.delta"
    path.write_bytes(fmt.encode_part(h, payload))
    return path


GOLDEN_PART = (b"RLTSYNC\x00\x02\x00\x00\x00\xd5\x00\x00\x00"
               b'{"kind":"delta","run_id":"r","attempt":"a4a4a4a4a4a4a4a4","step":4,"base_step":3,"rank":0,"world":1,'
               b'"entries":[{"name":"w","start":0,"stop":6,"offset":0,"length":4,"crc32":3984772369,"changes":2}],'
               b'"payload_len":4}'
               b"\xe0\xb6\x1f\xa2" b"abcd")
GOLDEN_MARKER = b'{"format_version": 2, "step": 4, "attempt": "a4a4a4a4a4a4a4a4", "manifest_bytes": 50, "manifest_crc32": 2892139011}'


def test_part_file_and_marker_golden_bytes(tmp_path):
    # every byte of a version-2 part file (prefix, header JSON, header CRC, payload) and of a marker
    assert _part(tmp_path).read_bytes() == GOLDEN_PART
    assert fmt.marker_bytes(b"x" * 50, dict(step=4, attempt=A4)) == GOLDEN_MARKER


def test_part_header_golden_prefix_and_round_trip(tmp_path):
    path = _part(tmp_path)
    raw = path.read_bytes()
    assert raw[:8] == b"RLTSYNC\0" and struct.unpack("<I", raw[8:12])[0] == 2
    header, start = fmt.read_part_header(path, expect=dict(step=4, run_id="r"), expect_bytes=len(raw))
    assert fmt.read_entry_bytes(path, start, header["entries"][0]) == b"abcd"


def test_entries_read_together_are_each_crc_checked_and_named(tmp_path, monkeypatch):
    blobs = [b"abcd", b"", b"0123456789", b"xyz"]
    entries, offset = [], 0
    for k, blob in enumerate(blobs):
        entries.append(dict(name=f"t{k}", start=0, stop=100, offset=offset, length=len(blob), crc32=fmt.crc32(blob),
                            changes=1))
        offset += len(blob)
    path = tmp_path / "rank-00000.delta"
    path.write_bytes(fmt.encode_part(dict(kind="delta", run_id="r", attempt=A4, step=4, base_step=3, rank=0, world=1,
                                          entries=entries), b"".join(blobs)))
    header, start = fmt.read_part_header(path)
    # any subset, in any order: each entry's own bytes
    picked = [header["entries"][k] for k in (3, 0, 2)]
    assert [bytes(b) for b in fmt.read_entries_bytes(path, start, picked)] == [b"xyz", b"abcd", b"0123456789"]
    assert fmt.read_entries_bytes(path, start, []) == []
    # entries more than the gap apart come from reads of their own, each in the order asked
    monkeypatch.setattr(fmt, "_ENTRY_READ_GAP", 0)
    assert [bytes(b) for b in fmt.read_entries_bytes(path, start, [header["entries"][3], header["entries"][0]])] \
        == [b"xyz", b"abcd"]
    monkeypatch.undo()
    assert fmt.read_entry_bytes(path, start, header["entries"][1]) == b""
    raw = bytearray(path.read_bytes())
    raw[start + 4 + 3] ^= 1  # a bit of t2's bytes
    path.write_bytes(bytes(raw))
    assert bytes(fmt.read_entries_bytes(path, start, picked[:2])[1]) == b"abcd"  # t2 not read: not checked
    with pytest.raises(fmt.CorruptBytesError, match="entry t2: CRC-32 mismatch"):
        fmt.read_entries_bytes(path, start, picked)
    path.write_bytes(bytes(raw[:start + 10]))  # cut inside t2
    with pytest.raises(fmt.TruncatedFileError, match="entry t2 ends past the end"):
        fmt.read_entries_bytes(path, start, header["entries"])


def test_oversized_header_is_refused_before_it_is_read(tmp_path):
    path = tmp_path / "rank-00000.delta"
    path.write_bytes(struct.pack("<8sII", fmt.MAGIC, 2, fmt.MAX_HEADER_BYTES + 1) + b"{}")
    with pytest.raises(fmt.HeaderTooLargeError):
        fmt.read_part_header(path)


def test_oversized_manifest_or_marker_is_refused(tmp_path):
    d = tmp_path / fmt.step_dir_name(4)
    d.mkdir()
    fmt.write_manifest(d, _manifest())
    marker = json.loads((d / fmt.COMPLETE_NAME).read_text())
    marker["manifest_bytes"] = fmt.MAX_MANIFEST_BYTES + 1
    (d / fmt.COMPLETE_NAME).write_text(json.dumps(marker))
    with pytest.raises(fmt.HeaderTooLargeError):
        fmt.read_manifest(d)
    (d / fmt.COMPLETE_NAME).write_bytes(b" " * (fmt.MAX_MARKER_BYTES + 1))
    with pytest.raises(fmt.HeaderTooLargeError):
        fmt.read_manifest(d)


def test_bad_magic_version_truncation_and_flips_are_refused(tmp_path):
    path = _part(tmp_path)
    good = path.read_bytes()
    cases = [(b"XXXXXXXX" + good[8:], fmt.BadMagicError),
             (good[:8] + struct.pack("<I", 9) + good[12:], fmt.FormatVersionError),
             (good[:-1], fmt.TruncatedFileError),
             (good + b"\0", fmt.TruncatedFileError)]
    flipped = bytearray(good)
    flipped[20] ^= 1  # inside the JSON header
    cases.append((bytes(flipped), fmt.CorruptBytesError))
    for data, error in cases:
        path.write_bytes(data)
        with pytest.raises(error):
            fmt.read_part_header(path)
    path.write_bytes(good)
    with pytest.raises(fmt.WrongStepError):
        fmt.read_part_header(path, expect=dict(step=5))
    with pytest.raises(fmt.TruncatedFileError):
        fmt.read_part_header(path, expect_bytes=len(good) + 1)
    with pytest.raises(fmt.MissingPartError):
        fmt.read_part_header(tmp_path / "rank-00009.delta")


def test_entries_that_overlap_or_leave_the_payload_are_refused(tmp_path):
    e = dict(name="w", start=0, stop=6, offset=2, length=4, crc32=0, changes=1)
    h = dict(kind="delta", run_id="r", attempt=A4, step=4, base_step=3, rank=0, world=1, entries=[e])
    path = _part(tmp_path, header=h, payload=b"abcd")
    with pytest.raises(fmt.ManifestSchemaError):
        fmt.read_part_header(path)


def test_a_part_path_that_is_a_directory_is_a_missing_part(tmp_path):
    (tmp_path / "rank-00000.delta").mkdir()
    with pytest.raises(fmt.MissingPartError, match="is a directory"):
        fmt.read_part_header(tmp_path / "rank-00000.delta")


@pytest.mark.timeout(20, method="thread")  # a reader that opened the pipe would wait here for a writer forever
def test_a_named_pipe_where_a_file_belongs_is_refused_without_waiting(tmp_path):
    d = tmp_path / fmt.step_dir_name(4)
    d.mkdir()
    fmt.write_manifest(d, _manifest())
    os.mkfifo(d / "rank-00000.delta")
    with pytest.raises(fmt.MissingPartError, match="rank-00000.delta: part file is a named pipe"):
        fmt.read_part_header(d / "rank-00000.delta")
    (d / fmt.MANIFEST_NAME).unlink()
    os.mkfifo(d / fmt.MANIFEST_NAME)
    with pytest.raises(fmt.MissingManifestError, match="manifest.json.* is a named pipe"):
        fmt.read_manifest(d)
    (d / fmt.COMPLETE_NAME).unlink()
    os.mkfifo(d / fmt.COMPLETE_NAME)
    with pytest.raises(fmt.StepNotReadyError, match="is a named pipe"):
        fmt.read_marker(d)


def test_a_marker_or_manifest_linked_from_outside_its_step_directory_is_refused(tmp_path):
    d = tmp_path / fmt.step_dir_name(4)
    d.mkdir()
    fmt.write_manifest(d, _manifest())
    for name in (fmt.MANIFEST_NAME, fmt.COMPLETE_NAME):
        outside = tmp_path / f"outside-{name}"
        (d / name).rename(outside)  # the very bytes, so only where they are is wrong
        os.symlink(outside, d / name)
        with pytest.raises(fmt.ManifestPathError, match=f"{name}: resolves to .*outside the step directory"):
            fmt.read_manifest(d)
        (d / name).unlink()
        outside.rename(d / name)
    assert fmt.read_manifest(d) == _manifest()


def _anchor_manifest(shape, entries):
    header = dict(kind="anchor", entries=entries)
    m = _manifest(kind="full", base_step=None, base_attempt=None, parts=[],
                  anchors=[dict(rank=0, file="rank-00000.anchor", bytes=100)])
    m["tensors"]["w"]["shape"] = shape
    m["tensors"].pop("w2")
    return m, header


@pytest.mark.parametrize("length", [10, 14])
def test_short_or_long_anchor_entries_are_refused(tmp_path, length):
    m, header = _anchor_manifest([2, 3], [dict(name="w", start=0, stop=6, offset=0, length=length, crc_block=1 << 20,
                                               crc32s=[0])])
    with pytest.raises(fmt.AnchorCoverError, match=r"entries\[0\].*length.*need 12"):
        fmt.check_part_entries(tmp_path / "rank-00000.anchor", header, m)


def test_anchor_slices_must_tile_every_tensor(tmp_path):
    def entry(start, stop):
        return dict(name="w", start=start, stop=stop, offset=0, length=(stop - start) * 2, crc_block=1 << 20, crc32s=[0])

    m, _ = _anchor_manifest([2, 3], [])
    a, b = tmp_path / "rank-00000.anchor", tmp_path / "rank-00001.anchor"
    fmt.check_cover(tmp_path, m, [(a, dict(kind="anchor", entries=[entry(0, 3)])),
                                  (b, dict(kind="anchor", entries=[entry(3, 6)]))])
    for parts, problem in (([entry(0, 3)], "cover \\[0, 3\\)"), ([entry(0, 4), entry(3, 6)], "overlaps"),
                           ([], "no anchor entry")):
        with pytest.raises(fmt.AnchorCoverError, match=problem):
            fmt.check_cover(tmp_path, m, [(a, dict(kind="anchor", entries=parts))])
