"""Receiver end to end on one worker: follow every step vs join late, bit-identical; one test per fault."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import torch
from sync_helpers import Trainer, assert_same_params, engine_cfg, make_receiver, reference_engine

from rltune.sync import codec
from rltune.sync import format as fmt
from rltune.sync.kernels.reference import MASK64, as_bits


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A trainer that published steps 0..5 (anchors at 0 and 3), and what the engine must hold at each."""
    root = tmp_path_factory.mktemp("bcast")
    tr = Trainer(root, interval=3)
    m0 = tr.pub.publish(0)
    states = {0: tr.wire_state()}
    for s in range(1, 6):
        tr.train_step()
        tr.pub.publish(s)
        states[s] = {k: v.clone() for k, v in tr.wire_state().items()}
    return dict(root=root, trainer=tr, m0=m0, states=states, cfg=engine_cfg(tr))


def _fresh_copy(run, tmp_path):
    root = tmp_path / "bcast"
    shutil.copytree(run["root"], root)
    return root


def _receiver_at(run, root, step, **kw):
    """A receiver that loaded anchor 3 (steps 0-2 are pruned by then) and followed deltas up to ``step``."""
    engine, rx = make_receiver(root, run["cfg"], run["m0"], **kw)
    for s in range(3, step + 1):
        rx.apply(s)
    assert rx.step == step and rx.valid
    return engine, rx


def _assert_at(run, engine, step):
    assert_same_params(engine, reference_engine(run["cfg"], run["states"][step]))


def _delta_path(root, step):
    return root / fmt.step_dir_name(step) / "rank-00000.delta"


# per-run apply (torch reference), the fused multi-tensor apply through its torch reference, its
# compiled CPU pass (what CPU vLLM engines use), and the fused Triton kernel (under
# TRITON_INTERPRET=1 on the CPU, as CI runs it)
APPLY_PATHS = {"per-run": dict(fused=False), "fused-ref": dict(fused=True, fused_backend="torch"),
               "fused-numba": dict(fused=True, fused_backend="numba"),
               "fused-triton": dict(fused=True, fused_backend="triton")}


def _apply_path(name):
    if name == "fused-triton" and os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        pytest.skip("the Triton kernel runs on a GPU or under TRITON_INTERPRET=1")
    return APPLY_PATHS[name]


@pytest.mark.parametrize("path", list(APPLY_PATHS))
@pytest.mark.parametrize("kind", ["adamw-bf16", "adamw-fp32-master", "signsgd-tied"])
def test_a_late_joiner_ends_bit_identical_to_a_follower(tmp_path, kind, path):
    kw = dict(adamw_bf16={}, adamw_fp32_master=dict(dtype=torch.float32, wire_dtype=torch.bfloat16),
              signsgd_tied=dict(optimizer="signsgd", tie=True, lr=1e-2))[kind.replace("-", "_")]
    tr = Trainer(tmp_path, interval=4, **kw)
    m0 = tr.pub.publish(0)
    cfg = engine_cfg(tr)
    follower, rx = make_receiver(tmp_path, cfg, m0, **_apply_path(path))
    assert rx.apply(0).action == "reload"
    for s in range(1, 7):
        tr.train_step()
        tr.pub.publish(s)
        assert rx.prefetch(s)
        report = rx.apply(s)
        assert report.action == "delta" and report.changes_applied > 0
        # the compiled CPU pass stages the patch while serving; the pause only stores it
        assert report.prestaged == ([s] if path == "fused-numba" else [])
    joiner, rj = make_receiver(tmp_path, cfg, m0, **_apply_path(path))
    report = rj.load_latest()
    assert (report.action, report.anchor, report.deltas) == ("reload", 4, [5, 6])  # joins at a non-anchor step
    ref = reference_engine(cfg, tr.wire_state())
    assert_same_params(follower, ref)
    assert_same_params(joiner, ref)
    assert rx.anchor_loads == 1 and rx.deltas_applied == 6


def test_a_patch_staged_before_another_write_is_applied_in_full(run, tmp_path):
    # staged against step 3, but the reload writes anchor 3 (and step 4 replays on it): the staged
    # patch is dropped and step 4 applied from its changes
    engine, rx = _receiver_at(run, run["root"], 3, fused=True, fused_backend="numba")
    assert rx.prefetch(4)
    assert rx._prefetched and "patch" in next(iter(rx._prefetched.values()))
    report = rx._update(lambda: rx._plan(4, force_reload=True))
    assert (report.action, report.anchor, report.deltas, report.prestaged) == ("reload", 3, [4], [])
    _assert_at(run, engine, 4)
    assert rx.prefetch(5) and rx.apply(5).prestaged == [5]
    _assert_at(run, engine, 5)


def test_applying_the_held_step_again_is_a_no_op(run, tmp_path):
    engine, rx = _receiver_at(run, run["root"], 4)
    assert rx.apply(4).action == "none"
    _assert_at(run, engine, 4)


def _expect_failure_then_heal(run, root, rx, engine, step, error, repair):
    """A fault found while reading leaves the engine valid at the step it held, its weights untouched,
    and the repaired step applies as a delta; one found after writing (a checksum) leaves it invalid,
    and it heals by anchor reload + replay."""
    held = rx.step
    with pytest.raises(error):
        rx.apply(step)
    if error is fmt.ChecksumMismatchError:
        assert not rx.valid
    else:
        assert rx.valid and rx.step == held
        _assert_at(run, engine, held)
    repair()
    report = rx.apply(step)
    assert report.action == ("reload" if error is fmt.ChecksumMismatchError else "delta")
    _assert_at(run, engine, step)


def test_bit_flip_in_a_delta_part_is_detected_and_heals(run, tmp_path):
    root = _fresh_copy(run, tmp_path)
    engine, rx = _receiver_at(run, root, 3)
    path = _delta_path(root, 4)
    good = path.read_bytes()
    bad = bytearray(good)
    bad[-10] ^= 0x04
    path.write_bytes(bytes(bad))
    _expect_failure_then_heal(run, root, rx, engine, 4, fmt.CorruptBytesError, lambda: path.write_bytes(good))


def test_bit_flip_in_an_anchor_is_detected(run, tmp_path):
    root = _fresh_copy(run, tmp_path)
    path = root / fmt.step_dir_name(3) / "rank-00000.anchor"
    good = path.read_bytes()
    bad = bytearray(good)
    bad[len(good) // 2] ^= 0x01
    path.write_bytes(bytes(bad))
    engine, rx = make_receiver(root, run["cfg"], run["m0"])
    report = rx.load_latest()  # falls back to anchor 0 and replays deltas 1..5 (anchor 3 as a delta)
    assert (report.anchor, report.deltas) == (0, [1, 2, 3, 4, 5])
    assert [(f["anchor"], f["error"]) for f in report.fallbacks] == [(3, "CorruptBytesError")]
    _assert_at(run, engine, 5)
    shutil.rmtree(root / fmt.step_dir_name(0))  # no older anchor left to fall back to
    engine, rx = make_receiver(root, run["cfg"], run["m0"])
    with pytest.raises(fmt.CorruptBytesError):
        rx.load_latest()
    path.write_bytes(good)
    assert rx.load_latest().anchor == 3
    _assert_at(run, engine, 5)


def _rewrite_part(path, edit_entry):
    """Re-encode a part with one entry changed and every CRC recomputed (bytes pass, values are wrong)."""
    header, start = fmt.read_part_header(path)
    raw = path.read_bytes()[start:]
    blobs = []
    for e in header["entries"]:
        blob = raw[e["offset"]:e["offset"] + e["length"]]
        blobs.append(edit_entry(e, blob) if header["kind"] == "delta" else edit_entry(e, blob))
    off = 0
    for e, b in zip(header["entries"], blobs, strict=True):
        e.update(offset=off, length=len(b))
        if header["kind"] == "delta":
            e["crc32"] = fmt.crc32(b)
        else:
            e["crc32s"] = [fmt.crc32(b[j:j + e["crc_block"]]) for j in range(0, len(b), e["crc_block"])]
        off += len(b)
    header.pop("payload_len")
    path.write_bytes(fmt.encode_part(header, b"".join(blobs)))
    return path.stat().st_size


def _restore(root, step, part, good):
    part.write_bytes(good)
    _fix_manifest_size(root, step, len(good))


def _fix_manifest_size(root, step, size, key="parts"):
    d = root / fmt.step_dir_name(step)
    m = json.loads((d / fmt.MANIFEST_NAME).read_text())
    m[key][0]["bytes"] = size
    fmt.write_manifest(d, m)


@pytest.mark.parametrize("path", list(APPLY_PATHS))
def test_wrong_values_with_valid_bytes_fail_the_tensor_checksum(run, tmp_path, path):
    # The bug peers report: the checksum of the bytes sent passes while the apply writes wrong values.
    root = _fresh_copy(run, tmp_path)
    engine, rx = _receiver_at(run, root, 3, **_apply_path(path))

    def plus_one(e, blob):
        idx, diff = codec.decode(blob, e["start"], e["stop"])
        diff[0] = diff[0] + 1 if diff[0] != -1 else 1
        return codec.encode(idx, diff, 16, e["start"], e["stop"])

    part = _delta_path(root, 4)
    good = part.read_bytes()
    _fix_manifest_size(root, 4, _rewrite_part(part, plus_one))
    _expect_failure_then_heal(run, root, rx, engine, 4, fmt.ChecksumMismatchError, lambda: _restore(root, 4, part, good))


def test_a_wrong_value_in_an_anchor_with_valid_crcs_fails_the_tensor_checksum(run, tmp_path):
    root = _fresh_copy(run, tmp_path)

    def flip_one(e, blob):
        b = bytearray(blob)
        if e["name"] == "model.layers.0.mlp.down_proj.weight":
            b[6] ^= 0x01
        return bytes(b)

    path = root / fmt.step_dir_name(3) / "rank-00000.anchor"
    _fix_manifest_size(root, 3, _rewrite_part(path, flip_one), key="anchors")
    shutil.rmtree(root / fmt.step_dir_name(0))  # no older anchor to fall back to
    engine, rx = make_receiver(root, run["cfg"], run["m0"])
    with pytest.raises(fmt.ChecksumMismatchError, match="down_proj"):
        rx.load_latest()


def test_truncated_part_is_detected_and_heals(run, tmp_path):
    root = _fresh_copy(run, tmp_path)
    engine, rx = _receiver_at(run, root, 3)
    path = _delta_path(root, 4)
    good = path.read_bytes()
    path.write_bytes(good[: len(good) // 2])
    _expect_failure_then_heal(run, root, rx, engine, 4, fmt.TruncatedFileError, lambda: path.write_bytes(good))


def test_missing_part_is_detected_and_heals(run, tmp_path):
    root = _fresh_copy(run, tmp_path)
    engine, rx = _receiver_at(run, root, 3)
    path = _delta_path(root, 4)
    good = path.read_bytes()
    path.unlink()
    _expect_failure_then_heal(run, root, rx, engine, 4, fmt.MissingPartError, lambda: path.write_bytes(good))


def test_a_part_from_another_step_is_detected(run, tmp_path):
    root = _fresh_copy(run, tmp_path)
    engine, rx = _receiver_at(run, root, 3)
    path = _delta_path(root, 5)
    good = path.read_bytes()
    other = _delta_path(root, 4).read_bytes()
    path.write_bytes(other)
    _fix_manifest_size(root, 5, len(other))  # even with the size made to match
    rx.apply(4)
    _expect_failure_then_heal(run, root, rx, engine, 5, fmt.WrongStepError, lambda: _restore(root, 5, path, good))


def test_double_applied_delta_is_refused_by_the_plan_and_caught_by_the_checksum(run, tmp_path):
    engine, rx = _receiver_at(run, run["root"], 4)
    assert rx.apply(4).action == "none"  # the plan never applies a delta onto its own result
    m4 = rx.store.manifest(4)
    rx._apply_delta(4, rx._staged_delta(4, m4), m4)  # force it past the plan (what a stale cache did to peers)
    with pytest.raises(fmt.ChecksumMismatchError):
        rx.verify(4)
    rx.valid = False
    assert rx.apply(4).action == "reload"
    _assert_at(run, engine, 4)


def test_skipped_delta_is_replayed_by_the_plan_and_caught_by_the_checksum(run, tmp_path):
    engine, rx = _receiver_at(run, run["root"], 3)
    m5 = rx.store.manifest(5)
    rx._apply_delta(5, rx._staged_delta(5, m5), m5)  # skips 4
    with pytest.raises(fmt.ChecksumMismatchError):
        rx.verify(5)
    engine2, rx2 = _receiver_at(run, run["root"], 3)
    report = rx2.apply(5)  # the plan follows base_step links: 4 then 5
    assert (report.action, report.anchor, report.deltas) == ("reload", 3, [4, 5])
    _assert_at(run, engine2, 5)


def test_off_by_one_step_bookkeeping_is_caught_and_heals(run, tmp_path):
    engine, rx = _receiver_at(run, run["root"], 3)
    rx.step = 4  # believes it holds step 4 but holds 3 (and 3's attempt): 5's base_attempt is not it
    report = rx.apply(5)
    assert (report.action, report.anchor, report.deltas) == ("reload", 3, [4, 5])
    _assert_at(run, engine, 5)
    engine, rx = _receiver_at(run, run["root"], 3)
    rx.step, rx.attempt = 4, rx.store.manifest(4)["attempt"]  # wholly wrong bookkeeping: the plan takes 5 as a delta
    with pytest.raises(fmt.ChecksumMismatchError):
        rx.apply(5)
    assert rx.apply(5).action == "reload"
    _assert_at(run, engine, 5)


def test_stale_directory_listing_is_revalidated_before_probing(tmp_path):
    tr = Trainer(tmp_path, interval=10)
    m0 = tr.pub.publish(0)
    engine, rx = make_receiver(tmp_path, engine_cfg(tr), m0)
    rx.apply(0)
    assert rx.store.steps(revalidate=False) == [0]  # the reader's listing is now cached without step 1
    tr.train_step()
    tr.pub.publish(1)
    assert rx.apply(1).action == "delta"  # found as a delta, not missed and turned into a reload
    assert rx.anchor_loads == 1


def test_manifest_path_outside_the_root_is_refused(run, tmp_path):
    root = _fresh_copy(run, tmp_path)
    engine, rx = _receiver_at(run, root, 3)
    d = root / fmt.step_dir_name(4)
    m = json.loads((d / fmt.MANIFEST_NAME).read_text())
    bad = dict(m, parts=[dict(rank=0, file="../../../etc/passwd", bytes=100)])
    raw = json.dumps(bad).encode()
    (d / fmt.MANIFEST_NAME).write_bytes(raw)
    (d / fmt.COMPLETE_NAME).write_bytes(fmt.marker_bytes(raw, bad))
    with pytest.raises(fmt.ManifestPathError, match="etc/passwd"):
        rx.apply(4)


def test_oversized_part_header_is_refused(run, tmp_path):
    root = _fresh_copy(run, tmp_path)
    engine, rx = _receiver_at(run, root, 3)
    path = _delta_path(root, 4)
    raw = bytearray(path.read_bytes())
    raw[12:16] = (fmt.MAX_HEADER_BYTES + 1).to_bytes(4, "little")
    path.write_bytes(bytes(raw))
    with pytest.raises(fmt.HeaderTooLargeError):
        rx.apply(4)


def test_a_pruned_base_is_a_chain_error_and_a_trainer_restart_forces_a_reload(tmp_path):
    tr = Trainer(tmp_path, interval=2)
    m0 = tr.pub.publish(0)
    cfg = engine_cfg(tr)
    engine, rx = make_receiver(tmp_path, cfg, m0)
    rx.apply(0)
    tr.train_step()
    tr.pub.publish(1)
    shutil.rmtree(tmp_path / fmt.step_dir_name(0))
    rx.valid = False
    with pytest.raises(fmt.ChainError, match="pruned"):
        rx.apply(1)
    tr.train_step()
    tr.pub.publish(2)  # anchor
    assert rx.apply(2).anchor == 2
    # the trainer restarts (new run id) and publishes a full checkpoint at step 3
    tr.pub.run_id = "run-b"
    tr.pub.force_full()
    tr.pub.publish(3)
    report = rx.apply(3)
    assert report.action == "reload" and report.anchor == 3 and rx.run_id == "run-b"
    assert_same_params(engine, reference_engine(cfg, tr.wire_state()))


def test_a_pluggable_apply_function_receives_mapped_changes(run, tmp_path):
    calls = []

    def counting_apply(target, pos, diff, idx):
        from rltune.sync.ops import apply_mapped_delta_ref
        calls.append(int(pos.numel()))
        return apply_mapped_delta_ref(target, pos, diff, idx)

    engine, rx = make_receiver(run["root"], run["cfg"], run["m0"], apply_fn=counting_apply)
    rx.apply(3)
    report = rx.apply(4)
    assert sum(calls) == report.changes_applied > 0
    _assert_at(run, engine, 4)
    # a broken kernel (writes nothing, claims the change) is caught by verification
    engine, rx = make_receiver(run["root"], run["cfg"], run["m0"], apply_fn=lambda t, p, d, i: 0)
    rx.apply(3)
    with pytest.raises(fmt.ChecksumMismatchError):
        rx.apply(4)


def test_running_shares_equal_a_full_recompute(run):
    engine, rx = _receiver_at(run, run["root"], 5)
    running = dict(rx._shares)
    rx.recompute_shares()
    assert running == rx._shares
    first = next(iter(running))
    assert 0 <= running[first] <= MASK64
    assert as_bits(next(engine.parameters()).data).dtype == torch.int16
    assert np.int64(rx.imap.tensors[first].held) > 0


def test_fused_apply_follows_an_engine_that_moved_a_parameter(run, tmp_path):
    # An engine that swaps a parameter's storage (a reload path that assigns .data) must not be patched
    # through the old address: the plan's tables are rebuilt before the launch.
    engine, rx = _receiver_at(run, run["root"], 3, **_apply_path("fused-ref"))
    name, p = next(iter(engine.named_parameters()))
    p.data = p.data.clone()
    rx.apply(4)
    _assert_at(run, engine, 4)


def test_fused_staging_skips_tensors_this_worker_does_not_hold(run):
    engine, rx = make_receiver(run["root"], run["cfg"], run["m0"], tp_rank=1, tp_size=2, fused=True,
                               fused_backend="torch")
    staged = rx._stage_changes(4, rx.store.manifest(4))
    held = {n for n, r in rx.imap.tensors.items() if r.held}
    assert set(staged["entry_names"]) <= held and staged["entry_names"]
    assert staged["idx_C"].numel() == int(staged["entry_offsets_E1"][-1]) and staged["val_C"].dtype == torch.int32


def test_short_runs_are_written_and_checksummed_as_the_run_by_run_loop_does():
    """A repacked MoE expert maps as many runs of a few elements: the anchor's indexed pieces write, and
    the joined spans checksum, exactly what one slice and one checksum per run would."""
    from rltune.sync.indexmap import TensorRuns
    from rltune.sync.kernels import checksum_pairs
    from rltune.sync.receiver import _SLICE_COMPARE_RUN, _pieces, _spans

    rng = np.random.default_rng(7)
    lengths = np.concatenate([rng.integers(1, 40, 3000), [_SLICE_COMPARE_RUN, _SLICE_COMPARE_RUN + 9]]).astype(np.int64)
    rng.shuffle(lengths)
    numel = int(lengths.sum())
    ckpt_start = np.cumsum(lengths) - lengths
    # two parameters (the tensor's halves); each run lands at a shuffled place (a tiled interleave moves every run)
    pids = (ckpt_start >= numel // 2).astype(np.int64)
    param_start = np.zeros(len(lengths), dtype=np.int64)
    sizes = []
    for pid in (0, 1):
        mine = np.flatnonzero(pids == pid)
        order = rng.permutation(mine)
        param_start[order] = np.cumsum(lengths[order]) - lengths[order]
        sizes.append(int(lengths[mine].sum()))
    src = torch.from_numpy(rng.integers(-2**31, 2**31, numel, dtype=np.int64).astype(np.int32))
    lo = 5  # the anchor slice read starts a few elements into the tensor: the first run is cut
    a = np.maximum(ckpt_start, lo)
    keep = np.flatnonzero(a < ckpt_start + lengths)
    want = [torch.zeros(n, dtype=torch.int32) for n in sizes]
    got = [torch.zeros(n, dtype=torch.int32) for n in sizes]
    for r in keep.tolist():
        p, b = int(param_start[r] + a[r] - ckpt_start[r]), int(ckpt_start[r] + lengths[r])
        want[pids[r]][p: p + b - int(a[r])] = src[int(a[r]): b]
    pieces = _pieces(pids[keep], param_start[keep] + a[keep] - ckpt_start[keep], a[keep] - lo,
                     ckpt_start[keep] + lengths[keep] - a[keep], src[lo:])
    assert sum(int(s.numel()) for _, _, s in pieces) == numel - lo
    assert len(pieces) <= 2 + 2  # the two long runs as slices, each parameter's short runs as one piece
    for pid, where, bits in pieces:
        if isinstance(where, int):
            got[pid][where: where + bits.numel()] = bits
        else:
            got[pid].index_copy_(0, where, bits)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    # Checksum shares over the joined spans equal the sum over every run's own slice.
    runs = TensorRuns("w", numel, ckpt_start, lengths, pids, param_start)
    spans = _spans(runs)
    assert len(spans) < len(lengths) // 10
    views = [want[pid][w[0]: w[1]] if isinstance(w, tuple) else want[pid][w] for pid, _, w in spans]
    joined = checksum_pairs(views, [c for _, c, _ in spans])
    per_run = checksum_pairs([want[int(p)][int(s): int(s + n)] for p, s, n in zip(pids, param_start, lengths, strict=True)],
                             ckpt_start.tolist())
    assert sum(c for c, _ in joined) % 2**64 == sum(c for c, _ in per_run) % 2**64
    from rltune.sync.kernels.reference import checksum2_add

    def total2(pairs):
        acc = 0
        for _, c2 in pairs:
            acc = checksum2_add(acc, c2)
        return acc
    assert total2(joined) == total2(per_run)
