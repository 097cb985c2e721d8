"""Tensor-parallel engines on the CPU: several gloo workers, one plan per TP group, group-wide verification.

The trainer publishes in this process; the engine workers are real processes (torch.multiprocessing
spawn) joined by a gloo process group. Each worker records its own index map from the toy engine's
``load_weights`` (fused qkv/gate_up, TP slicing, KV heads replicated when TP > KV heads).
"""

from __future__ import annotations

import json
import os
import socket

import pytest
import torch
import torch.multiprocessing as mp
from sync_helpers import Trainer, engine_cfg, make_receiver, reference_engine

from rltune.errors import RltuneError
from rltune.sync import format as fmt
from rltune.sync.ops import apply_mapped_delta_ref


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class KernelLaunchError(RltuneError):
    """Stands in for a GPU apply kernel that fails on one worker only."""


def _worker(rank, world, port, root, cfg, m0, state_path, out_dir):
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    group = dist.new_group(list(range(world)), backend="gloo")
    result = {}
    try:
        state = torch.load(state_path)
        ref = reference_engine(cfg, state, rank, world)

        def equal(engine):
            pa, pb = dict(engine.named_parameters()), dict(ref.named_parameters())
            return all(torch.equal(pa[n], pb[n]) for n in pa)

        # A follower: anchor 3, then delta 4 fails on the last worker only, then heals, then delta 5.
        follower, rx = make_receiver(root, cfg, m0, rank, world, group=group)
        result["first"] = rx.apply(3).action
        if rank == world - 1:
            def failing(t, p, d, i):
                raise KernelLaunchError("apply kernel failed on this worker")
            rx.apply_fn = failing
        try:
            rx.apply(4)
            result["fault"] = "none"
        except RltuneError as e:
            result["fault"] = type(e).__name__
        rx.apply_fn = apply_mapped_delta_ref
        result["heal"] = rx.apply(4).action
        rx.prefetch(5)
        result["last"] = rx.apply(5).action
        result["follower_equal"] = equal(follower)
        # A fresh engine joining at step 5 (not an anchor): anchor 3, only its own rows, replay 4 and 5,
        # through the fused multi-tensor apply (its torch reference) over this rank's row/column windows.
        joiner, rj = make_receiver(root, cfg, m0, rank, world, group=group, fused=True, fused_backend="torch")
        report = rj.load_latest()
        result["join"] = [report.action, report.anchor, report.deltas]
        result["joiner_equal"] = equal(joiner)
        result["multiplicity_k"] = rj._multiplicity["model.layers.0.self_attn.k_proj.weight"]
        result["multiplicity_q"] = rj._multiplicity["model.layers.0.self_attn.q_proj.weight"]
    finally:
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)
        dist.destroy_process_group()


def _run_tp(tmp_path, tp, kv_heads):
    root = tmp_path / "bcast"
    tr = Trainer(root, interval=3, kv_heads=kv_heads)
    m0 = tr.pub.publish(0)
    for s in range(1, 6):
        tr.train_step()
        tr.pub.publish(s)
    state_path = tmp_path / "state5.pt"
    torch.save(tr.wire_state(), state_path)
    mp.spawn(_worker, args=(tp, _free_port(), str(root), engine_cfg(tr), m0, str(state_path), str(tmp_path)),
             nprocs=tp, join=True)
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(tp)]


def _check(results, tp, kv_heads):
    for r, res in enumerate(results):
        assert res["first"] == "reload" and res["heal"] == "reload" and res["last"] == "delta", res
        # the failing worker reports its own error; every other worker fails the same update with it
        assert res["fault"] == ("KernelLaunchError" if r == tp - 1 else "UpdateFailedError"), res
        assert res["follower_equal"] and res["joiner_equal"], res
        assert res["join"] == ["reload", 3, [4, 5]]
        assert res["multiplicity_k"] == max(1, tp // kv_heads) and res["multiplicity_q"] == 1


def test_tp2_with_replicated_kv_heads_follows_fails_together_and_joins_bit_identical(tmp_path):
    _check(_run_tp(tmp_path, tp=2, kv_heads=1), tp=2, kv_heads=1)


@pytest.mark.slow
def test_tp4_with_kv_heads_replicated_twice(tmp_path):
    _check(_run_tp(tmp_path, tp=4, kv_heads=2), tp=4, kv_heads=2)


def test_an_uneven_cover_is_refused_when_the_map_is_checked(tmp_path):
    # One worker of a TP=2 layout alone holds half of each sliced tensor: not verifiable as a group of one.
    tr = Trainer(tmp_path, interval=3)
    m0 = tr.pub.publish(0)
    engine, rx = make_receiver(tmp_path, engine_cfg(tr), m0, tp_rank=0, tp_size=2)
    with pytest.raises(fmt.IndexMapError, match="even cover"):
        rx.apply(0)


def _fault_worker(rank, world, port, root, cfg, m0, state_path, out_dir, scenario):
    """Faults on one worker of a TP group, through the public API; every worker reports what it saw."""
    import datetime
    import time

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=20))
    group = dist.new_group(list(range(world)), backend="gloo", timeout=datetime.timedelta(seconds=10))
    result = {}
    try:
        state = torch.load(state_path)
        ref = reference_engine(cfg, state, rank, world)
        engine, rx = make_receiver(root, cfg, m0, rank, world, group=group)
        rx.apply(3)
        if scenario == "dies":
            if rank == world - 1:
                def dying(t, p, d, i):
                    os._exit(0)  # the worker process is gone in the middle of writing
                rx.apply_fn = dying
            t0 = time.monotonic()
            try:
                rx.apply(4)
                result["error"] = None
            except RltuneError as e:
                result["error"] = type(e).__name__
            result["seconds"] = time.monotonic() - t0
            result["valid"] = rx.valid
            return

        def attempt(fn):
            t0 = time.monotonic()
            try:
                fn()
                return None, time.monotonic() - t0
            except RltuneError as e:
                return type(e).__name__, time.monotonic() - t0
            except Exception as e:  # noqa: BLE001 - a raw exception is what this test must not see
                return f"raw {type(e).__name__}", time.monotonic() - t0

        # a step that is not there: every worker says so, none changes or turns invalid
        result["not_ready"] = attempt(lambda: rx.apply(9))[0]
        result["not_ready_kept"] = [rx.valid, rx.step]
        # a failure before any write on one worker only: the group fails together, all keep step 3
        if rank == world - 1:
            def refuse():
                raise fmt.UpdateFailedError("this worker's engine refuses the update")
            rx.before_write = refuse
        result["pre_write"] = attempt(lambda: rx.apply(4))[0]
        result["pre_write_kept"] = [rx.valid, rx.step]
        rx.before_write = lambda: None
        result["then_delta"] = rx.apply(4).action
        # a raw exception in one worker's apply kernel: typed on it, reaches the other within the time-out,
        # every worker turns invalid and reloads + replays the same way
        if rank == world - 1:
            def broken(t, p, d, i):
                raise ValueError("index out of range in the apply kernel")
            rx.apply_fn = broken
        result["raw"], result["raw_seconds"] = attempt(lambda: rx.apply(5))
        result["raw_valid"] = rx.valid
        rx.apply_fn = apply_mapped_delta_ref
        report = rx.apply(5)
        result["heal"] = [report.action, report.anchor, report.deltas]
        pa, pb = dict(engine.named_parameters()), dict(ref.named_parameters())
        result["equal"] = all(torch.equal(pa[n], pb[n]) for n in pa)
    finally:
        with open(os.path.join(out_dir, f"{scenario}{rank}.json"), "w") as f:
            json.dump(result, f)
        if scenario != "dies":
            dist.destroy_process_group()


def _spawn_faults(tmp_path, scenario):
    root = tmp_path / "bcast"
    tr = Trainer(root, interval=3, kv_heads=1)  # one KV head: replicated on both workers
    m0 = tr.pub.publish(0)
    for s in range(1, 6):
        tr.train_step()
        tr.pub.publish(s)
    torch.save(tr.wire_state(), tmp_path / "state5.pt")
    mp.spawn(_fault_worker, args=(2, _free_port(), str(root), engine_cfg(tr), m0, str(tmp_path / "state5.pt"),
                                  str(tmp_path), scenario), nprocs=2, join=True)
    return [json.loads(p.read_text()) if (p := tmp_path / f"{scenario}{r}.json").exists() else None for r in range(2)]


def test_tp2_every_worker_fails_typed_together_keeps_its_weights_before_writing_and_heals_after(tmp_path):
    results = _spawn_faults(tmp_path, "faults")
    for rank, res in enumerate(results):
        assert res["not_ready"] == "StepNotReadyError" and res["not_ready_kept"] == [True, 3], res
        assert res["pre_write"] == "UpdateFailedError" and res["pre_write_kept"] == [True, 3], res
        assert res["then_delta"] == "delta", res
        # the failing worker names its own error (a raw one typed); the other learns of it from the flag
        assert res["raw"] == ("InternalSyncError" if rank == 1 else "UpdateFailedError"), res
        assert res["raw_seconds"] < 10 and not res["raw_valid"], res  # well inside the group's 10 s time-out
        assert res["heal"] == ["reload", 3, [4, 5]] and res["equal"], res


def test_tp2_a_worker_that_dies_mid_update_fails_the_other_within_the_time_out(tmp_path):
    survivor, dead = _spawn_faults(tmp_path, "dies")
    assert dead is None or dead == {}, dead  # it exited before writing anything
    assert survivor["error"] in ("GroupUnreachableError", "UpdateFailedError"), survivor
    assert survivor["seconds"] < 10 + 5 and not survivor["valid"], survivor
