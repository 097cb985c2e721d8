"""Format rules: manifest schema, path confinement, caps, magic/version, truncation, golden prefix."""

from __future__ import annotations

import copy
import json
import os
import struct

import pytest

from rltune.sync import format as fmt


def _manifest(**over):
    m = dict(format_version=1, run_id="r", step=4, kind="delta", base_step=3, world=1,
             parts=[dict(rank=0, file="rank-00000.delta", bytes=100)], anchors=[],
             tensors={"w": dict(dtype="bfloat16", shape=[2, 3], checksum="12", tied_to=None),
                      "w2": dict(dtype="bfloat16", shape=[2, 3], checksum="12", tied_to="w")})
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
    (lambda m: m.update(format_version=2), fmt.FormatVersionError),
    (lambda m: m["parts"][0].update(file="../../etc/passwd"), fmt.ManifestPathError),
    (lambda m: m["parts"][0].update(file="/abs/rank-00000.delta"), fmt.ManifestPathError),
])
def test_manifest_rule_violations_raise_their_own_error(mutate, error):
    m = copy.deepcopy(_manifest())
    mutate(m)
    with pytest.raises(error):
        fmt.validate_manifest(m)


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
    h = header or dict(kind="delta", run_id="r", step=4, base_step=3, rank=0, world=1,
                       entries=[dict(name="w", start=0, stop=6, offset=0, length=4, crc32=fmt.crc32(payload), changes=2)])
    path = tmp_path / "rank-00000.delta"
    path.write_bytes(fmt.encode_part(h, payload))
    return path


def test_part_header_golden_prefix_and_round_trip(tmp_path):
    path = _part(tmp_path)
    raw = path.read_bytes()
    assert raw[:8] == b"RLTSYNC\0" and struct.unpack("<I", raw[8:12])[0] == 1
    header, start = fmt.read_part_header(path, expect=dict(step=4, run_id="r"), expect_bytes=len(raw))
    assert fmt.read_entry_bytes(path, start, header["entries"][0]) == b"abcd"


def test_oversized_header_is_refused_before_it_is_read(tmp_path):
    path = tmp_path / "rank-00000.delta"
    path.write_bytes(struct.pack("<8sII", fmt.MAGIC, 1, fmt.MAX_HEADER_BYTES + 1) + b"{}")
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
    h = dict(kind="delta", run_id="r", step=4, base_step=3, rank=0, world=1, entries=[e])
    path = _part(tmp_path, header=h, payload=b"abcd")
    with pytest.raises(fmt.ManifestSchemaError):
        fmt.read_part_header(path)
