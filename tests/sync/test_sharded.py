"""FSDP2 (fully_shard) trainers publish their own shards: real gloo processes, a real transformers Qwen3.

Each rank steps its local shards in chunks and writes its own delta parts and anchor slices; no
collective of parameters runs while it steps or publishes (the gathering calls raise there). Only
after publishing does the test gather the state (``full_tensor``) to compare a toy engine that
followed every step with a full reload of it, byte for byte. Dims are chosen so that shards are
uneven (vocab 125, hidden 30, intermediate 45) and some are empty (q_norm/k_norm of 2 rows at 4 ranks).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket

import pytest
import torch
import torch.multiprocessing as mp
from sync_helpers import make_receiver, reference_engine

from rltune.sync import format as fmt
from rltune.sync.toy_engine import ToyEngineConfig

GATHERS = ("all_gather", "all_gather_into_tensor", "all_gather_object", "gather", "broadcast", "all_to_all")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _config():
    from transformers import Qwen3Config

    return Qwen3Config(vocab_size=125, hidden_size=30, intermediate_size=45, num_hidden_layers=2, num_attention_heads=3,
                       num_key_value_heads=1, head_dim=2, max_position_embeddings=32, tie_word_embeddings=False)


class NoGather:
    """Makes every gathering collective and DTensor gather raise while active; counts the calls."""

    def __init__(self):
        import torch.distributed as dist
        from torch.distributed import distributed_c10d
        from torch.distributed.tensor import DTensor

        self.calls: list[str] = []
        self.targets = [(m, n) for m in (dist, distributed_c10d) for n in GATHERS if hasattr(m, n)]
        self.targets += [(DTensor, "full_tensor"), (DTensor, "redistribute")]

    def __enter__(self):
        self.saved = [(m, n, getattr(m, n)) for m, n in self.targets]
        for m, n in self.targets:
            def refuse(*a, _n=n, **k):
                self.calls.append(_n)
                raise AssertionError(f"{_n} called while publishing")
            setattr(m, n, refuse)
        return self

    def __exit__(self, *exc):
        for m, n, f in self.saved:
            setattr(m, n, f)


def _sharded_model(world, seed=0, placement=None):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(_config()).to(torch.bfloat16)
    mesh = init_device_mesh("cpu", (world,))
    kw = {} if placement is None else dict(shard_placement_fn=placement)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, **kw)
    fully_shard(model, mesh=mesh, **kw)
    return model


def _worker(rank, world, port, out, optimizer, steps):
    import torch.distributed as dist
    from torch.distributed.tensor import Shard

    from rltune.sync.sender import DeltaPublisher, UnmappablePlacementError

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    result = {}
    try:
        model = _sharded_model(world)
        if optimizer == "muon":  # Muon for the hidden matrices, AdamW for embeddings, norms and the head
            hidden = [p for n, p in model.named_parameters() if p.ndim == 2 and "layers" in n]
            rest = [p for n, p in model.named_parameters() if not (p.ndim == 2 and "layers" in n)]
            opt = [torch.optim.Muon(hidden, lr=2e-2), torch.optim.AdamW(rest, lr=1e-2, weight_decay=0.01)]
        else:
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01, fused=optimizer == "fused")
        pub = DeltaPublisher(model, opt, os.path.join(out, "bcast"), 3, run_id="fsdp", incarnation="0",
                             chunk_elements=700, differ="torch")
        result["rank_world"] = [pub.rank, pub.world]
        gen = torch.Generator().manual_seed(1)
        guard = NoGather()
        states = {}

        def gathered():
            return {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.state_dict().items()}

        with guard:
            pub.publish(0)
        states[0] = gathered()
        for s in range(1, steps + 1):
            ids = torch.randint(0, 125, (2, 12), generator=gen)
            model(input_ids=ids, labels=ids).loss.backward()  # FSDP2's own all-gathers run here, not in the publisher
            # Muon's Newton-Schulz iteration over a sharded matrix runs DTensor collectives of the update
            # (not of the weights): its step is not guarded, its publish is
            with guard if optimizer != "muon" else contextlib.nullcontext():
                pub.step()
            for o in (opt if isinstance(opt, list) else [opt]):
                o.zero_grad()
            with guard:
                pub.publish(s)
            states[s] = gathered()
        result["gather_calls"] = list(guard.calls)
        with guard:  # the guard is live: a gather inside it is refused
            try:
                next(p for p in model.parameters()).full_tensor()
                result["guard_works"] = False
            except AssertionError:
                result["guard_works"] = True
        if rank == 0:
            torch.save(states, os.path.join(out, "states.pt"))
        # a placement the publisher cannot map: refused before anything is written
        bad = _sharded_model(world, placement=lambda p: Shard(1) if p.shape == (30, 6) else Shard(0))  # o_proj
        root = os.path.join(out, f"refused-{rank}")
        try:
            DeltaPublisher(bad, torch.optim.AdamW(bad.parameters()), root, 3, run_id="x", differ="torch")
            result["refused"] = None
        except UnmappablePlacementError as e:
            result["refused"] = str(e)
        result["refused_root_exists"] = os.path.exists(root)
    finally:
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)
        dist.destroy_process_group()


def _run(tmp_path, world, optimizer, steps=4):
    mp.spawn(_worker, args=(world, _free_port(), str(tmp_path), optimizer, steps), nprocs=world, join=True)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    for r, res in enumerate(results):
        assert res["rank_world"] == [r, world]
        assert res["gather_calls"] == [] and res["guard_works"], res
        assert res["refused"] is not None and "self_attn.o_proj.weight" in res["refused"] and "Shard(dim=1)" in \
            res["refused"], res
        assert not res["refused_root_exists"]
    states = torch.load(tmp_path / "states.pt")
    cfg = ToyEngineConfig.from_hf(_config())
    m0 = json.loads((tmp_path / "bcast" / fmt.step_dir_name(0) / "manifest.json").read_text())
    engine, rx = make_receiver(tmp_path / "bcast", cfg, m0)
    actions = []
    for s in range(steps + 1):
        actions.append(rx.apply(s).action)
        ref = reference_engine(cfg, states[s])
        pa, pb = dict(engine.named_parameters()), dict(ref.named_parameters())
        assert all(torch.equal(pa[n], pb[n]) for n in pa), s
        assert states[s]["model.embed_tokens.weight"].dtype == torch.bfloat16
    assert actions == ["reload"] + ["delta"] * steps, actions  # a follower takes the anchor step's delta part
    assert not torch.equal(states[0]["model.layers.0.mlp.down_proj.weight"], states[steps]["model.layers.0.mlp.down_proj.weight"])
    return results


def test_fsdp2_two_ranks_fused_adamw_publish_their_shards_bytes_exact_with_no_gather(tmp_path):
    _run(tmp_path, 2, "fused")


@pytest.mark.slow
def test_fsdp2_four_ranks_with_empty_shards_foreach_adamw(tmp_path):
    _run(tmp_path, 4, "foreach")


def test_fsdp2_two_ranks_muon_with_adamw_beside_it_bytes_exact(tmp_path):
    _run(tmp_path, 2, "muon", steps=4)
