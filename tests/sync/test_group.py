"""The one TP-group protocol (rltune.sync.group): decide, fail together, typed errors that keep their cause.

The protocol runs here over a real gloo group of two spawned processes (torch.distributed, as the
receiver and the vLLM worker use it), and over a stand-in whose collectives fail, for a peer that
is gone. ``tests/sync/test_sync_tp.py`` runs the receiver's updates over it, ``test_vllm.py`` the
vLLM worker's attach.
"""

from __future__ import annotations

import ast
import json
import os
import pickle
import socket
from pathlib import Path

import pytest
import torch.multiprocessing as mp

from rltune.errors import RltuneError, WrongTypeError
from rltune.sync import format as fmt
from rltune.sync.group import SOLO, TorchCollectives, TpGroup, as_typed

SYNC = Path(__file__).resolve().parents[2] / "rltune" / "sync"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _outcome(fn) -> dict:
    try:
        return dict(value=fn())
    except RltuneError as e:
        cause = e.__cause__
        return dict(error=type(e).__name__, message=str(e), cause=None if cause is None else type(cause).__name__)


def _gloo_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    import datetime

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    group = dist.new_group(list(range(world)), backend="gloo", timeout=datetime.timedelta(seconds=20))
    tp = TpGroup(TorchCollectives(group))
    res = dict(rank=tp.rank)

    def raw():
        raise ValueError("index 7 is out of bounds")

    def artifact():  # an rltune error whose constructor its pickle cannot call again (three arguments)
        raise WrongTypeError("job.yaml", "model.dtype", "'fp64' is not one of bfloat16, float32")

    def refuse_on(who):
        def fn():
            if rank == who:
                raise fmt.ChainError("step 4 is missing")
            return rank * 10
        return fn

    res["value"] = _outcome(lambda: tp.decide(lambda: {"plan": [3, 4], "rank": rank}, "planning"))
    res["raw"] = _outcome(lambda: tp.decide(raw, "planning the update"))
    res["artifact"] = _outcome(lambda: tp.decide(artifact, "planning the update"))
    res["phase_ok"] = _outcome(lambda: tp.phase(lambda: rank * 10, "reading step 5's delta"))
    res["phase_one_fails"] = _outcome(lambda: tp.phase(refuse_on(1), "reading step 5's delta"))
    res["phase_raw"] = _outcome(lambda: tp.phase(raw if rank == 0 else lambda: None, "applying step 5's delta"))
    top = (1 << 64) - 1  # both shares near the top of the ring: their sum wraps
    res["sums"] = tp.all_reduce([top - rank, 5 + rank, 0])
    res["max"] = tp.all_reduce([rank, 7 - rank], op="max")
    with open(os.path.join(out_dir, f"group{rank}.json"), "w") as f:
        json.dump(res, f)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def gloo_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("group")
    mp.spawn(_gloo_worker, args=(2, _free_port(), str(out)), nprocs=2, join=True)
    return [json.loads((out / f"group{r}.json").read_text()) for r in range(2)]


def test_rank_zeros_decision_reaches_every_worker(gloo_results):
    assert [r["rank"] for r in gloo_results] == [0, 1]
    assert all(r["value"] == dict(value={"plan": [3, 4], "rank": 0}) for r in gloo_results)


def test_a_raw_error_of_rank_zero_is_typed_on_every_worker_and_keeps_its_cause_where_it_happened(gloo_results):
    rank0, rank1 = (r["raw"] for r in gloo_results)
    want = "planning the update: ValueError: index 7 is out of bounds"
    assert rank0 == dict(error="InternalSyncError", message=want, cause="ValueError")
    assert rank1 == dict(error="InternalSyncError", message=want, cause=None)  # a cause does not cross processes


def test_an_error_its_pickle_cannot_rebuild_still_reaches_every_worker_with_its_message(gloo_results):
    with pytest.raises(TypeError):  # what torch's own unpickling would have raised on rank 1
        pickle.loads(pickle.dumps(WrongTypeError("f", "x", "y")))
    rank0, rank1 = (r["artifact"] for r in gloo_results)
    want = "job.yaml: model.dtype: 'fp64' is not one of bfloat16, float32"
    assert rank0 == dict(error="WrongTypeError", message=want, cause=None)
    assert rank1 == dict(error="UpdateFailedError", message=want, cause=None)


def test_a_phase_that_fails_on_one_worker_fails_on_every_worker(gloo_results):
    assert [r["phase_ok"] for r in gloo_results] == [dict(value=0), dict(value=10)]
    rank0, rank1 = (r["phase_one_fails"] for r in gloo_results)
    assert rank1 == dict(error="ChainError", message="step 4 is missing", cause=None)
    assert rank0["error"] == "UpdateFailedError" and rank0["message"].startswith(
        "reading step 5's delta failed on another worker of this TP group")
    raw0, raw1 = (r["phase_raw"] for r in gloo_results)
    assert raw0 == dict(error="InternalSyncError", message="applying step 5's delta: ValueError: index 7 is out of "
                        "bounds", cause="ValueError")
    assert raw1["error"] == "UpdateFailedError"


def test_sums_are_taken_in_the_checksum_ring_and_maxima_as_they_are(gloo_results):
    top = (1 << 64) - 1
    for r in gloo_results:
        assert r["sums"] == [(top + top - 1) % (1 << 64), 11, 0]
        assert r["max"] == [1, 7]


class _Gone:
    """Collectives of a group whose other worker died: every call fails as gloo's time-out does."""

    rank = 1

    def broadcast_object(self, obj):
        raise RuntimeError("Connection closed by peer [127.0.0.1]:29500")

    def all_gather_ints(self, values):
        raise RuntimeError("Timed out waiting 10000ms for recv operation to complete")


def test_a_peer_that_is_gone_is_a_typed_error_after_on_lost_on_every_collective():
    lost = []
    tp = TpGroup(_Gone(), on_lost=lambda: lost.append(1), lost="attach again")
    with pytest.raises(fmt.GroupUnreachableError, match=r"TP rank 0 did not send its plan \(Connection closed.*"
                                                          r"; attach again$"):
        tp.decide(lambda: 1, "planning", sends="its plan")
    with pytest.raises(fmt.GroupUnreachableError, match=r"another worker of this TP group did not answer \(Timed out"):
        tp.phase(lambda: 1, "reading")
    with pytest.raises(fmt.GroupUnreachableError):
        tp.all_reduce([1, 2])
    assert lost == [1, 1, 1]
    assert tp.all_reduce([]) == []  # nothing to reduce: no collective, nothing to lose


def test_a_worker_alone_decides_and_reduces_by_itself():
    tp = TpGroup()
    assert tp.collectives is SOLO and tp.rank == 0
    assert tp.decide(lambda: 5, "planning") == 5
    assert tp.all_reduce([(1 << 64) + 3, 2]) == [3, 2] and tp.all_reduce([4, 1], op="max") == [4, 1]
    with pytest.raises(fmt.InternalSyncError, match="^planning: KeyError: 'x'$") as info:
        tp.decide(lambda: {}["x"], "planning")
    assert isinstance(info.value.__cause__, KeyError)
    with pytest.raises(fmt.ChainError, match="missing"):
        tp.phase(lambda: (_ for _ in ()).throw(fmt.ChainError("missing")), "reading")
    with pytest.raises(ValueError, match="op must be"):
        tp.all_reduce([1], op="min")


def test_as_typed_keeps_rltune_errors_and_the_cause_of_any_other():
    chain = fmt.ChainError("step 3 is missing")
    assert as_typed(chain, "planning") is chain
    raw = OSError(5, "Input/output error")
    typed = as_typed(raw, "reading step 3's anchor")
    assert isinstance(typed, fmt.InternalSyncError) and typed.__cause__ is raw
    assert str(typed) == "reading step 3's anchor: OSError: [Errno 5] Input/output error"


def test_the_group_module_is_the_only_one_of_rltune_sync_that_runs_a_tp_collective():
    # one protocol: the receiver and the vLLM worker reach their TP group only through rltune.sync.group
    # (the nccl transport broadcasts weights, not a TP group's plan: it is a transport of its own)
    users = {}
    for path in sorted(SYNC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                    and ast.unparse(node.func.value) in ("dist", "torch.distributed"):
                if node.func.attr not in ("get_rank", "get_world_size", "get_global_rank", "new_group",
                                          "init_process_group", "destroy_process_group", "is_initialized"):
                    users.setdefault(str(path.relative_to(SYNC)), set()).add(node.func.attr)
    assert set(users) == {"group.py", "transports/nccl.py"}, users
    for name in ("receiver.py", "vllm/worker.py"):
        imported = {a.name for node in ast.walk(ast.parse((SYNC / name).read_text())) if isinstance(node, ast.ImportFrom)
                    and node.module == "rltune.sync.group" for a in node.names}
        assert {"TpGroup", "as_typed"} <= imported, (name, imported)
