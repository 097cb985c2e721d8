"""record_conversion on real transformers models (random init from tiny configs): the map it records, applied
to the trainer's tensors, gives bit for bit the checkpoint transformers' own save_pretrained writes; conversions
that compute with the values are refused."""

from __future__ import annotations

import pytest
import torch
import transformers
from safetensors.torch import load_file
from transformers.core_model_loading import ConversionOps, Transpose, WeightConverter

from rltune.errors import RltuneError
from rltune.sync.conversion import Conversion, ConversionError, record_conversion

E = 4  # experts per MoE layer
SMALL = dict(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=8, tie_word_embeddings=False)
MOES = {
    "qwen3_moe": lambda: transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        **SMALL, intermediate_size=48, moe_intermediate_size=16, num_experts=E, num_experts_per_tok=2)),
    "mixtral": lambda: transformers.MixtralForCausalLM(transformers.MixtralConfig(
        **SMALL, intermediate_size=24, num_local_experts=E, num_experts_per_tok=2)),
    # GLM-4.5's MoE: a dense first layer, a shared expert, a router bias buffer beside the routed experts
    "glm4_moe": lambda: transformers.Glm4MoeForCausalLM(transformers.Glm4MoeConfig(
        **SMALL, intermediate_size=48, moe_intermediate_size=16, n_routed_experts=E, num_experts_per_tok=2,
        n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1)),
}


def _model(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return MOES[kind]().to(torch.bfloat16)


def _saved(model, tmp_path) -> dict[str, torch.Tensor]:
    """The checkpoint transformers itself writes for ``model``."""
    model.save_pretrained(tmp_path)
    files = sorted(tmp_path.glob("*.safetensors"))
    assert files, "save_pretrained wrote no safetensors file"
    out = {}
    for f in files:
        out.update(load_file(f))
    return out


@pytest.mark.parametrize("kind", sorted(MOES))
def test_the_checkpoint_built_through_the_runs_equals_what_save_pretrained_writes(kind, tmp_path):
    model = _model(kind)
    conv = record_conversion(model)
    saved = _saved(model, tmp_path)
    assert not conv.is_identity
    assert list(conv.checkpoint_tensors()) == list(conv.ckpt_names)
    assert set(conv.ckpt_names) == set(saved)
    for name, t in saved.items():
        assert conv.checkpoint_tensors()[name] == (tuple(t.shape), t.dtype), name
    built = conv.to_checkpoint(model.state_dict())
    fused = [n for n in conv.trainer_tensors() if "experts" in n and len(conv.runs(n)) > 1]
    assert fused, "no fused expert tensor: the test would pass without any conversion"
    for name, t in saved.items():
        assert t.float().abs().sum() > 0 or "bias" in name, f"{name} is all zeros: the comparison proves nothing"
        assert torch.equal(built[name].view(torch.int16), t.view(torch.int16)), name


@pytest.mark.parametrize("kind", sorted(MOES))
def test_a_fused_expert_tensor_takes_one_run_per_expert_and_projection(kind):
    conv = record_conversion(_model(kind))
    gate_up = [n for n in conv.trainer_tensors() if n.endswith("experts.gate_up_proj")]
    down = [n for n in conv.trainer_tensors() if n.endswith("experts.down_proj")]
    assert gate_up and down
    for n in gate_up:
        runs = conv.runs(n)
        assert len(runs) == 2 * E
        proj = ["w1", "w3"] if kind == "mixtral" else ["gate_proj", "up_proj"]
        assert [r[2].rsplit(".", 3)[-3:-1] for r in runs] == [[str(e), p] for e in range(E) for p in proj]
    for n in down:
        assert len(conv.runs(n)) == E
    for n, (shape, _) in conv.trainer_tensors().items():
        runs = conv.runs(n)
        assert runs[0][0] == 0 and sum(r[1] for r in runs) == torch.Size(shape).numel()
        assert all(a[0] + a[1] == b[0] for a, b in zip(runs, runs[1:], strict=False)), n


def test_a_dense_qwen3_is_the_identity_and_matches_save_pretrained(tmp_path):
    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(**{**SMALL, "tie_word_embeddings": True}, intermediate_size=48)
    model = transformers.Qwen3ForCausalLM(cfg).to(torch.bfloat16)
    conv = record_conversion(model)
    assert conv.is_identity
    assert all(conv.runs(n) == [(0, torch.Size(s).numel(), n, 0)] for n, (s, _) in conv.trainer_tensors().items())
    saved = _saved(model, tmp_path)
    # save_pretrained drops the tied head; the conversion keeps it under its own name (the publisher sends it once)
    assert set(conv.ckpt_names) - set(saved) == {"lm_head.weight"}
    built = conv.to_checkpoint(model.state_dict())
    for name, t in saved.items():
        assert torch.equal(built[name].view(torch.int16), t.view(torch.int16)), name


def test_a_plain_torch_module_has_the_identity_conversion():
    conv = record_conversion(torch.nn.Linear(3, 5))
    assert conv.is_identity and conv.ckpt_names == ["weight", "bias"]
    assert conv.runs("weight") == [(0, 15, "weight", 0)]


def test_locate_agrees_with_the_runs_element_for_element():
    conv = record_conversion(_model("qwen3_moe"))
    for name, (shape, _) in conv.trainer_tensors().items():
        numel = torch.Size(shape).numel()
        want_id = torch.empty(numel, dtype=torch.int64)
        want_pos = torch.empty(numel, dtype=torch.int64)
        for t0, n, ckpt, c0 in conv.runs(name):
            want_id[t0:t0 + n] = conv.ckpt_names.index(ckpt)
            want_pos[t0:t0 + n] = torch.arange(c0, c0 + n)
        ids, pos = conv.locate(name, torch.arange(numel))
        assert torch.equal(ids, want_id) and torch.equal(pos, want_pos), name
        pick = torch.randperm(numel, generator=torch.Generator().manual_seed(1))[: max(1, numel // 7)]
        ids, pos = conv.locate(name, pick)
        assert torch.equal(ids, want_id[pick]) and torch.equal(pos, want_pos[pick]), name
    empty_ids, empty_pos = conv.locate(name, torch.empty(0, dtype=torch.int64))
    assert empty_ids.numel() == 0 and empty_pos.numel() == 0


@pytest.mark.parametrize("world", [2, 3, 5])
def test_dim0_shards_map_through_runs_in_without_touching_other_elements(world, tmp_path):
    """Each FSDP2 rank holds rows [r*c, (r+1)*c) of every tensor (the last shard shorter or empty); building the
    checkpoint from every rank's own slice through runs_in writes each checkpoint element exactly once."""
    model = _model("qwen3_moe")
    conv = record_conversion(model)
    saved = _saved(model, tmp_path)
    state = model.state_dict()
    built = {n: torch.full(s, float("nan"), dtype=d) for n, (s, d) in conv.checkpoint_tensors().items()}
    writes = {n: torch.zeros(torch.Size(s).numel(), dtype=torch.int32) for n, (s, _) in conv.checkpoint_tensors().items()}
    saw_empty = False
    for name, t in state.items():
        rows = t.shape[0] if t.dim() else 1
        per_row = t.numel() // rows
        chunk = -(-rows // world)
        for rank in range(world):
            a = min(rank * chunk, rows) * per_row
            b = min((rank + 1) * chunk, rows) * per_row
            local = t.reshape(-1)[a:b].clone()  # all a rank holds
            runs = conv.runs_in(name, a, b)
            saw_empty |= a == b
            assert sum(n for _, n, _, _ in runs) == b - a
            for t0, n, ckpt, c0 in runs:
                assert a <= t0 and t0 + n <= b
                built[ckpt].view(-1)[c0:c0 + n] = local[t0 - a:t0 - a + n]
                writes[ckpt][c0:c0 + n] += 1
    for name, t in saved.items():
        assert torch.equal(writes[name], torch.ones_like(writes[name])), name
        assert torch.equal(built[name].view(torch.int16), t.view(torch.int16)), name
    if world == 5:
        assert saw_empty, "no empty last shard: the sweep misses the case FSDP2 makes for E=4 rows on 5 ranks"


def test_runs_in_refuses_a_slice_outside_the_tensor_and_unknown_names():
    conv = record_conversion(_model("qwen3_moe"))
    name = "model.layers.0.mlp.experts.down_proj"
    numel = torch.Size(conv.trainer_tensors()[name][0]).numel()
    assert conv.runs_in(name, numel, numel) == []
    with pytest.raises(ConversionError, match=r"down_proj: slice \[0, \d+\) is outside"):
        conv.runs_in(name, 0, numel + 1)
    with pytest.raises(ConversionError, match="not a tensor of the model"):
        conv.runs("model.layers.9.mlp.experts.down_proj")
    with pytest.raises(ConversionError, match="outside its"):
        conv.locate(name, torch.tensor([numel]))
    assert issubclass(ConversionError, RltuneError)


# -- hand-written converters: what save_pretrained would do with them is refused, naming both tensors --------

class OnSave(ConversionOps):
    """Loads as it is (identity); its reverse, the op save_pretrained runs, is ``op``."""

    def __init__(self, op: ConversionOps):
        self.op = op

    def convert(self, input_dict, source_patterns, target_patterns, **kwargs):
        return {target_patterns[0]: _one(input_dict)}

    @property
    def reverse_op(self) -> ConversionOps:
        return self.op


class Scale(ConversionOps):
    def __init__(self, factor: float):
        self.factor = factor

    def convert(self, input_dict, source_patterns, target_patterns, **kwargs):
        return {target_patterns[0]: _one(input_dict) * self.factor}


class Duplicate(ConversionOps):
    def convert(self, input_dict, source_patterns, target_patterns, **kwargs):
        x = _one(input_dict)
        return {t: x.clone() for t in target_patterns}


class KeepFirstHalf(ConversionOps):
    def convert(self, input_dict, source_patterns, target_patterns, **kwargs):
        return {target_patterns[0]: torch.chunk(_one(input_dict), 2, dim=0)[0].contiguous()}


class Cast(ConversionOps):
    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype

    def convert(self, input_dict, source_patterns, target_patterns, **kwargs):
        return {target_patterns[0]: _one(input_dict).to(self.dtype)}


def _one(input_dict) -> torch.Tensor:
    (x,) = input_dict.values()
    return x[0] if isinstance(x, list) else x


def _with_conversions(conversions) -> torch.nn.Module:
    model = _model("qwen3_moe")
    model._weight_conversions = conversions  # what from_pretrained attaches; save_pretrained reverses it
    return model


O_PROJ = "model.layers.0.self_attn.o_proj.weight"


@pytest.mark.parametrize(("conversions", "error"), [
    ([WeightConverter("self_attn.o_proj.weight", "self_attn.o_proj.weight", [OnSave(Scale(0.5))])],
     rf"trainer tensor {O_PROJ} -> checkpoint tensor {O_PROJ}: element 0 holds .* computes with the values"),
    ([WeightConverter(["self_attn.o_proj.weight", "self_attn.o_copy.weight"], "self_attn.o_proj.weight",
                      [OnSave(Duplicate())])],
     rf"trainer tensor {O_PROJ}: element 0 lands in checkpoint tensors {O_PROJ} and "
     r"model\.layers\.0\.self_attn\.o_copy\.weight: the conversion duplicates"),
    ([WeightConverter("self_attn.o_proj.weight", "self_attn.o_proj.weight", [OnSave(KeepFirstHalf())])],
     rf"trainer tensor {O_PROJ}: element 512 lands in no checkpoint tensor .*{O_PROJ}.*drops values"),
    ([WeightConverter("self_attn.o_proj.weight", "self_attn.o_proj.weight", [OnSave(Cast(torch.float32))])],
     rf"trainer tensor {O_PROJ} -> checkpoint tensor {O_PROJ}: the conversion casts the values to torch.float32"),
    # float64 holds the codes exactly, so only the dtype the real tensors get shows this cast
    ([WeightConverter("self_attn.o_proj.weight", "self_attn.o_proj.weight", [OnSave(Cast(torch.float64))])],
     rf"trainer tensor {O_PROJ} \(torch.bfloat16\) -> checkpoint tensor {O_PROJ} \(torch.float64\): .*casts"),
], ids=["scale", "duplicate", "drop", "cast", "cast-exact"])
def test_a_conversion_that_does_not_move_values_whole_is_refused_naming_both_tensors(conversions, error):
    with pytest.raises(ConversionError, match=error):
        record_conversion(_with_conversions(conversions))


def test_a_transpose_is_a_permutation_and_is_accepted():
    model = _with_conversions([WeightConverter("self_attn.o_proj.weight", "self_attn.o_proj.weight",
                                               [Transpose(0, 1)])])
    conv = record_conversion(model)
    state = model.state_dict()
    built = conv.to_checkpoint(state)
    # save_pretrained reverses Transpose(0, 1) with Transpose(1, 0): the checkpoint holds o_proj transposed
    for name in (O_PROJ, "model.layers.1.self_attn.o_proj.weight"):
        assert torch.equal(built[name].view(torch.int16), state[name].t().contiguous().view(torch.int16))
        assert len(conv.runs(name)) == state[name].numel()  # a transpose moves every element on its own
    assert isinstance(conv, Conversion) and not conv.is_identity


# -- FSDP2: the map recorded from a fully_shard model, each rank's own shard through runs_in ---------------

def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _fsdp_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    import os

    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    # 3 experts and 95 vocabulary rows on 2 ranks: uneven shards (the last one shorter)
    cfg = transformers.Qwen3MoeConfig(**{**SMALL, "vocab_size": 95}, intermediate_size=48, moe_intermediate_size=16,
                                      num_experts=3, num_experts_per_tok=2)
    model = transformers.Qwen3MoeForCausalLM(cfg).to(torch.bfloat16)
    unsharded = record_conversion(model).fingerprint()
    if rank == 0:  # the weights before sharding: the reference checkpoint is written from them
        torch.save({n: t.clone() for n, t in model.state_dict().items()}, os.path.join(out_dir, "full.pt"))
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    conv = record_conversion(model)
    built = {n: torch.zeros(s, dtype=d).view(-1) for n, (s, d) in conv.checkpoint_tensors().items()}
    writes = {n: torch.zeros(t.numel(), dtype=torch.int32) for n, t in built.items()}
    uneven = 0
    for name, p in model.state_dict().items():
        assert p.placements == (Shard(0),), (name, p.placements)
        local = p.to_local().reshape(-1)
        rows = p.shape[0]
        per_row = p.numel() // rows
        a = min(rank * -(-rows // world), rows) * per_row  # FSDP2's dim-0 chunks: ceil(rows / world) rows each
        uneven += int(local.numel() != -(-rows // world) * per_row)
        for t0, n, ckpt, c0 in conv.runs_in(name, a, a + local.numel()):
            built[ckpt][c0:c0 + n] = local[t0 - a:t0 - a + n]
            writes[ckpt][c0:c0 + n] += 1
    torch.save(dict(same=unsharded == conv.fingerprint(), uneven=uneven, built=built, writes=writes),
               os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.mark.slow  # two spawned processes that import transformers: 15-30 s on the 2-core CI machine
def test_a_fully_sharded_model_records_the_same_map_and_each_rank_maps_its_own_shard(tmp_path):
    import torch.multiprocessing as mp

    world = 2
    mp.spawn(_fsdp_worker, args=(world, _free_port(), str(tmp_path)), nprocs=world, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    assert all(r["same"] for r in ranks), "fully_shard changed the recorded map"
    assert ranks[-1]["uneven"] > 0, "no uneven shard: the sweep misses FSDP2's shorter last shard"
    cfg = transformers.Qwen3MoeConfig(**{**SMALL, "vocab_size": 95}, intermediate_size=48, moe_intermediate_size=16,
                                      num_experts=3, num_experts_per_tok=2)
    with torch.device("meta"):
        reference = transformers.Qwen3MoeForCausalLM(cfg)
    reference.load_state_dict(torch.load(tmp_path / "full.pt"), assign=True)
    saved = _saved(reference, tmp_path / "ckpt")
    for name, t in saved.items():
        writes = sum(r["writes"][name] for r in ranks)
        assert torch.equal(writes, torch.ones_like(writes)), name
        built = sum(r["built"][name].view(torch.int16).to(torch.int32) for r in ranks)  # each element from one rank
        assert torch.equal(built, t.reshape(-1).view(torch.int16).to(torch.int32)), name
