"""Sender: chunked optimizer steps are exact, deltas come from the step, kinds/ties/statics/pruning."""

from __future__ import annotations

import copy
import gc
import os
from types import SimpleNamespace

import pytest
import torch
from sync_helpers import Trainer, assert_same_params, engine_cfg, make_receiver, reference_engine, tiny_qwen3

from rltune.sync import format as fmt
from rltune.sync.chunked import _PLANS, chunked_step
from rltune.sync.sender import DeltaPublisher, DeltaPublisherConfig, PublisherConfigError, SignSGD
from rltune.sync.store import BroadcastStore


def _grads(model, seed):
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g).to(p.dtype)


def _odd_model(dtype):
    torch.manual_seed(0)
    m = torch.nn.ParameterDict({"a": torch.nn.Parameter(torch.randn(5, 7)), "b": torch.nn.Parameter(torch.randn(13)),
                                "c": torch.nn.Parameter(torch.randn(3, 4, 5))})
    return m.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk", [1, 7, 64, 10**9])
@pytest.mark.parametrize("opt_name", ["adamw", "signsgd"])
def test_chunked_step_is_bit_identical_to_the_plain_step(dtype, chunk, opt_name):
    a, b = _odd_model(dtype), _odd_model(dtype)
    make = (lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)) if opt_name == "adamw" \
        else (lambda m: SignSGD(m.parameters(), lr=1e-2, weight_decay=0.1))
    oa, ob = make(a), make(b)
    seen = []
    for step in range(3):
        _grads(a, step), _grads(b, step)
        oa.step()
        chunked_step(ob, SimpleNamespace(before=seen.append, after=lambda chunks: None), chunk)
    for (n, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb), n
    assert not torch.equal(a["a"], _odd_model(dtype)["a"])  # the steps did move the weights
    assert max(sum(e - s for _, s, e in update) for update in seen) <= chunk
    if opt_name == "adamw":
        assert all(float(ob.state[p]["step"]) == 3.0 for p in b.parameters())


def test_a_broadcast_without_an_optimizer_step_is_a_full_checkpoint(tmp_path):
    tr = Trainer(tmp_path, interval=3)
    assert tr.pub.publish(0)["kind"] == "full"
    assert tr.pub.publish(1)["kind"] == "full"  # nothing stepped in between
    tr.train_step()
    m = tr.pub.publish(2)
    assert m["kind"] == "delta" and m["base_step"] == 1
    tr.train_step()
    m = tr.pub.publish(3)
    assert m["kind"] == "anchor" and len(m["parts"]) == 1 and len(m["anchors"]) == 1


def test_a_step_that_changed_most_elements_goes_out_full_and_engines_reload_it(tmp_path):
    tr = Trainer(tmp_path, interval=10, dense_fraction=0.25)
    cfg = engine_cfg(tr)
    m0 = tr.pub.publish(0)
    follower, rx = make_receiver(tmp_path, cfg, m0)
    rx.apply(0)
    for group in tr.opt.param_groups:
        group["lr"] = 1e-6  # a small step: few bf16 elements change, a delta
    tr.train_step()
    small = tr.pub.publish(1)
    changed = sum(e["changes"] for e in _entries(tmp_path, 1))
    assert small["kind"] == "delta" and 0 < changed < 0.25 * sum(p.numel() for p in tr.model.parameters())
    assert rx.apply(1).action == "delta"
    for group in tr.opt.param_groups:
        group["lr"] = 1e-1  # a large step changes nearly every element
    tr.train_step()
    dense = tr.pub.publish(2)
    assert dense["kind"] == "full" and dense["base_step"] is None and not dense["parts"]
    assert rx.apply(2).action == "reload"
    for group in tr.opt.param_groups:
        group["lr"] = 1e-6
    tr.train_step()
    assert tr.pub.publish(3)["base_step"] == 2  # the chain goes on from the full step
    rx.apply(3)
    assert_same_params(follower, reference_engine(cfg, tr.wire_state()))


def _entries(root, step):
    from rltune.sync import format as fmt_

    path = root / fmt_.step_dir_name(step) / fmt_.part_file_name(0, "delta")
    header, _ = fmt_.read_part_header(path)
    return header["entries"]


def test_plain_coded_deltas_carry_the_entropy_coded_changes_and_engines_follow_them(tmp_path):
    from rltune.sync import codec

    trainers = {c: Trainer(tmp_path / c, interval=10, coding=c) for c in ("entropy", "plain")}
    follower, rx = None, None
    for step in range(4):
        for coding, tr in trainers.items():
            if step:
                tr.train_step()
            m = tr.pub.publish(step)
            if coding == "plain":
                if step == 0:
                    follower, rx = make_receiver(tmp_path / coding, engine_cfg(tr), m)
                assert rx.apply(step).action == ("reload" if step == 0 else "delta")
    plain, entropy = trainers["plain"], trainers["entropy"]
    assert all(torch.equal(v, entropy.wire_state()[k]) for k, v in plain.wire_state().items())  # the same steps
    assert_same_params(follower, reference_engine(engine_cfg(plain), plain.wire_state()))
    for step in (1, 2, 3):
        # both trainers took the same steps: the same changes, coded two ways
        for mine, theirs in zip(_entries(tmp_path / "plain", step), _entries(tmp_path / "entropy", step), strict=True):
            assert (mine["name"], mine["changes"]) == (theirs["name"], theirs["changes"])
        path = tmp_path / "plain" / fmt.step_dir_name(step) / fmt.part_file_name(0, "delta")
        header, start = fmt.read_part_header(path)
        for e in header["entries"]:
            assert fmt.read_entry_bytes(path, start, e)[0] == codec.MODE_PLAIN


@pytest.mark.parametrize("dtype,wire", [(torch.bfloat16, None), (torch.float32, torch.bfloat16)])
def test_a_weight_changed_outside_the_step_raises(tmp_path, dtype, wire):
    tr = Trainer(tmp_path, dtype=dtype, wire_dtype=wire)
    tr.pub.publish(0)
    with torch.no_grad():
        tr.model.model.norm.weight[3] += 1.0
    tr.train_step()
    with pytest.raises(fmt.WeightChangedOutsideStepError, match="model.norm.weight"):
        tr.pub.publish(1)
    # the delta's part was written beside the check: the refusal removed it, and nothing names step 1
    assert os.listdir(tmp_path / fmt.step_dir_name(1)) == []
    assert BroadcastStore(tmp_path).complete_steps() == [0]
    tr.pub.force_full()
    assert tr.pub.publish(2)["kind"] == "full"
    tr.train_step()
    assert tr.pub.publish(4)["kind"] == "delta"  # the running checksums follow the weights again


def test_tied_weights_go_once_in_deltas_and_under_every_name_in_anchors(tmp_path):
    tr = Trainer(tmp_path, tie=True, interval=2)
    m0 = tr.pub.publish(0)
    t = m0["tensors"]
    assert t["lm_head.weight"]["tied_to"] == "model.embed_tokens.weight"
    assert t["lm_head.weight"]["checksum"] == t["model.embed_tokens.weight"]["checksum"]
    tr.train_step()
    tr.pub.publish(1)
    tr.train_step()
    tr.pub.publish(2)
    d = tmp_path / fmt.step_dir_name(2)
    delta, _ = fmt.read_part_header(d / "rank-00000.delta")
    anchor, _ = fmt.read_part_header(d / "rank-00000.anchor")
    delta_names = [e["name"] for e in delta["entries"]]
    assert "model.embed_tokens.weight" in delta_names and "lm_head.weight" not in delta_names
    assert {"model.embed_tokens.weight", "lm_head.weight"} <= {e["name"] for e in anchor["entries"]}


def test_frozen_tensors_are_diffed_against_the_checkpoint_copy(tmp_path):
    model = tiny_qwen3()
    frozen = model.model.norm.weight
    opt = torch.optim.AdamW([p for p in model.parameters() if p is not frozen], lr=1e-3)
    pub = DeltaPublisher(model, opt, tmp_path, interval=10, run_id="r", chunk_elements=500)
    m0 = pub.publish(0)
    assert "model.norm.weight" in pub.static_names
    ids = torch.randint(0, 128, (2, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    pub.step()
    with torch.no_grad():
        frozen[:5] += 0.5  # e.g. an EMA or a buffer updated outside the optimizer: published, not an error
    m1 = pub.publish(1)
    delta, _ = fmt.read_part_header(tmp_path / fmt.step_dir_name(1) / "rank-00000.delta")
    entry = next(e for e in delta["entries"] if e["name"] == "model.norm.weight")
    assert entry["changes"] == 5
    cfg = engine_cfg(type("T", (), {"model": model})())
    engine, rx = make_receiver(tmp_path, cfg, m0)
    rx.apply(0)
    rx.apply(1)
    state = {k: v.detach() for k, v in model.state_dict().items()}
    assert_same_params(engine, reference_engine(cfg, state))
    assert m1["kind"] == "delta"


@pytest.mark.parametrize("keep", [1, 2])
def test_old_chains_are_pruned_only_after_newer_anchors_were_complete_one_broadcast_earlier(tmp_path, keep):
    tr = Trainer(tmp_path, interval=3)
    tr.pub = DeltaPublisher(tr.model, tr.opt, tmp_path, 3, run_id="run-a", chunk_elements=1000, keep_anchors=keep)
    tr.pub.publish(0)
    present = []
    for s in range(1, 11):
        tr.train_step()
        tr.pub.publish(s)
        present.append(BroadcastStore(tmp_path).complete_steps())
    if keep == 1:
        assert present[2] == [0, 1, 2, 3]         # anchor 3 just completed: chain 0..2 kept
        assert present[3] == [3, 4]               # one broadcast later it goes
        assert present[5] == [3, 4, 5, 6]
        assert present[6] == [6, 7]
    else:  # the default: the previous anchor's chain stays, to fall back to when the latest anchor is damaged
        assert present[3] == [0, 1, 2, 3, 4]
        assert present[5] == [0, 1, 2, 3, 4, 5, 6]
        assert present[6] == [3, 4, 5, 6, 7]      # anchors 3 and 6 kept, the chain before 3 goes
        assert present[9] == [6, 7, 8, 9, 10]
    assert not any(n.startswith(".") for n in os.listdir(tmp_path / fmt.step_dir_name(10)))  # no temp files left


def test_two_trainer_ranks_write_their_own_slices_without_a_gather(tmp_path):
    ranks = [Trainer(tmp_path, interval=2, rank=r, world=2) for r in (1, 0)]  # same seed: replicas
    for tr in ranks:
        m0 = tr.pub.publish(0)  # rank 1 first: rank 0 finalizes once both summaries exist
    for s in (1, 2, 3):
        for tr in ranks:
            tr.train_step()
            m = tr.pub.publish(s)
    assert m["world"] == 2 and [p["rank"] for p in m["parts"]] == [0, 1]
    h1, _ = fmt.read_part_header(tmp_path / fmt.step_dir_name(2) / "rank-00001.anchor")
    emb = next(e for e in h1["entries"] if e["name"] == "model.embed_tokens.weight")
    assert (emb["start"], emb["stop"]) == (64 * 32, 128 * 32)  # rows 64..127 of 128
    cfg = engine_cfg(ranks[1])
    engine, rx = make_receiver(tmp_path, cfg, m0)
    assert rx.load_latest().step == 3
    assert_same_params(engine, reference_engine(cfg, ranks[1].wire_state()))


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="the GPU encoder's kernels on these CPU weights need TRITON_INTERPRET=1 (on a CUDA "
                           "machine too: the kernels would look for the weights on the GPU)")
def test_gpu_encoder_publishes_the_host_encoders_bytes(tmp_path):
    # the same model, data and steps published twice: the delta parts must be byte-identical
    parts = []
    for encoder in ("host", "gpu"):
        root = tmp_path / encoder
        tr = Trainer(root, interval=10, lr=1e-5, encoder=encoder, incarnation="i")  # a few % changed, as real steps
        tr.pub.publish(0)
        tr.train_step()
        tr.pub.publish(1)
        parts.append((root / fmt.step_dir_name(1) / "rank-00000.delta").read_bytes())
    assert parts[0] == parts[1]
    header, _ = fmt.read_part_header(tmp_path / "gpu" / fmt.step_dir_name(1) / "rank-00000.delta")
    assert sum(e["changes"] for e in header["entries"]) > 100


# These trainers hold their weights on the CPU, where the diff kernels run only in the interpreter;
# test_triton_differ_on_the_gpu_publishes_the_reference_bytes covers CUDA weights.
KERNELS_RUN = os.environ.get("TRITON_INTERPRET") == "1"


@pytest.mark.skipif(not KERNELS_RUN, reason="the diff kernels on CPU tensors need TRITON_INTERPRET=1")
@pytest.mark.parametrize(("optimizer", "dtype", "wire_dtype", "rank", "world"), [
    ("adamw", torch.bfloat16, None, 0, 1),
    ("signsgd", torch.float32, torch.bfloat16, 0, 1),  # fp32 master weights sent as bf16
    ("adamw", torch.bfloat16, None, 1, 2),  # this rank's rows only
])
def test_triton_differ_publishes_the_reference_bytes(tmp_path, optimizer, dtype, wire_dtype, rank, world):
    # the same model, data and steps published with each differ: every part file byte-identical,
    # through deltas and an anchor
    published = {}
    for differ in ("torch", "triton"):
        root = tmp_path / differ
        lr = 1e-5 if optimizer == "adamw" else 1e-3
        tr = Trainer(root, interval=3, optimizer=optimizer, lr=lr, dtype=dtype, wire_dtype=wire_dtype, rank=rank,
                     world=world, differ=differ, change_capacity=1.0, incarnation="i")
        assert (tr.pub.recorder.sink is not None) == (differ == "triton")
        tr.pub.publish(0)
        kinds = []
        for step in (1, 2, 3):
            tr.train_step()
            kinds.append(tr.pub.publish(step))
        published[differ] = {p.relative_to(root): p.read_bytes() for p in sorted(root.rglob("rank-*"))}
        if rank == 0:
            assert [m["kind"] for m in kinds] == ["delta", "delta", "anchor"]
    assert published["torch"].keys() == published["triton"].keys() and len(published["torch"]) >= 6
    for name, data in published["torch"].items():
        assert published["triton"][name] == data, name
    header, _ = fmt.read_part_header(tmp_path / "triton" / fmt.step_dir_name(1) / f"rank-{rank:05d}.delta")
    assert sum(e["changes"] for e in header["entries"]) > 100


@pytest.mark.skipif(not KERNELS_RUN, reason="the diff kernels on CPU tensors need TRITON_INTERPRET=1")
@pytest.mark.parametrize(("rank", "world"), [(0, 1), (1, 2)])
def test_fused_adamw_updates_are_stepped_by_the_kernels_and_their_deltas_verify(tmp_path, rank, world):
    # fused AdamW on CPU weights, the fused step forced on (on CUDA it is on by default): every update
    # holding only this rank's elements is stepped by the kernels, the others are staged; publish
    # checks the running checksums the recorded changes give against the live weights, step after step
    tr = Trainer(tmp_path, interval=3, lr=1e-5, rank=rank, world=world, run_id="fused", differ="triton",
                 change_capacity=1.0, fused=True)
    pub = tr.pub
    assert not pub.recorder.sink.fuse_adamw  # CPU weights: off unless asked for
    pub.recorder.sink.fuse_adamw = True
    fused, append, staged, stage = [], pub.recorder.sink.adamw_append, [], pub.recorder.sink.stage
    pub.recorder.sink.adamw_append = lambda *a: fused.append(append(*a)) or fused[-1]
    pub.recorder.sink.stage = lambda *a: staged.append(1) or stage(*a)
    pub.publish(0)
    kinds = []
    for step in (1, 2, 3):
        tr.train_step()
        kinds.append(pub.publish(step))
    assert fused and all(fused)
    if world == 1:  # rank 0 writes the manifest
        assert [m["kind"] for m in kinds] == ["delta", "delta", "anchor"]
        assert not staged
    else:  # updates that hold rows of both ranks are staged, the others stepped by the kernels
        assert staged


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["loop", "foreach", "fused"])
def test_triton_differ_on_the_gpu_publishes_the_reference_bytes(tmp_path, impl):
    # CUDA weights of several sizes: a tensor of many diff blocks and tiles split into chunks, and
    # tensors smaller than one block packed into one update; the same gradients for every copy, three
    # steps (the third an anchor); every part file byte-identical and the weights identical to a plain
    # AdamW step's, with each of torch's AdamW implementations
    gen = torch.Generator().manual_seed(0)
    shapes = {"big": (3000, 1111), "mid": (70000,), "odd": (5, 7), "one": (1,)}
    init = {k: torch.randn(s, generator=gen).to(torch.bfloat16) for k, s in shapes.items()}
    copies, published = {}, {}
    for name in ("plain", "torch", "triton"):
        model = torch.nn.ParameterDict({k: torch.nn.Parameter(v.cuda()) for k, v in init.items()})
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, fused=impl == "fused" or None,
                                foreach=impl == "foreach")
        pub = None if name == "plain" else DeltaPublisher(model, opt, tmp_path / name, 3, differ=name, run_id="gpu",
                                                            chunk_elements=1 << 20, change_capacity=0.5,
                                                            incarnation="i")
        if pub is not None:
            pub.publish(0)
        copies[name] = (model, opt, pub)
    for step in (1, 2, 3):
        grads = {k: torch.randn(s, generator=gen).to(torch.bfloat16).cuda() for k, s in shapes.items()}
        for model, opt, pub in copies.values():
            for k, p in model.items():
                p.grad = grads[k].clone()
            (opt.step if pub is None else pub.step)()
            if pub is not None:
                pub.publish(step)
        for k, p in copies["plain"][0].items():
            for name in ("torch", "triton"):
                assert torch.equal(copies[name][0][k].view(torch.int16), p.view(torch.int16)), (name, k, step)
    for name in ("torch", "triton"):
        root = tmp_path / name
        published[name] = {p.relative_to(root): p.read_bytes() for p in sorted(root.rglob("rank-*"))}
    assert published["torch"].keys() == published["triton"].keys()
    for name, data in published["torch"].items():
        assert published["triton"][name] == data, name
    parts = {(p.parent.name, p.suffix) for p in published["triton"]}
    want = {(fmt.step_dir_name(1), ".delta"), (fmt.step_dir_name(2), ".delta"), (fmt.step_dir_name(3), ".anchor")}
    assert want <= parts
    header, _ = fmt.read_part_header(tmp_path / "triton" / fmt.step_dir_name(2) / "rank-00000.delta")
    assert sum(e["changes"] for e in header["entries"]) > 10_000


def test_a_parameter_given_new_storage_between_steps_is_diffed_where_it_now_lives(tmp_path):
    # the publisher keeps views of each update's parameters from step to step; a parameter whose
    # .data was replaced must be read from its new storage (else the step's changes go unseen and
    # the publish finds the weights changed outside the step)
    tr = Trainer(tmp_path, interval=10, lr=1e-2)
    m0 = tr.pub.publish(0)
    tr.train_step()
    tr.pub.publish(1)
    for p in tr.model.parameters():
        p.data = p.data.clone()
    tr.train_step()
    assert tr.pub.publish(2)["kind"] == "delta"
    cfg = engine_cfg(tr)
    engine, rx = make_receiver(tmp_path, cfg, m0)
    assert rx.load_latest().step == 2
    assert_same_params(engine, reference_engine(cfg, tr.wire_state()))
    # a second publisher on the same optimizer prepares its own entries; the first one's go with it
    updates = [u for entry in _PLANS[tr.opt].values() for u in entry[1]]
    assert all(len(u.cache) == 1 for u in updates)
    second = DeltaPublisher(tr.model, tr.opt, tmp_path / "second", 10, run_id="run-b", chunk_elements=1000)
    second.publish(0)
    tr.model(input_ids=torch.randint(0, 128, (2, 16)), labels=torch.randint(0, 128, (2, 16))).loss.backward()
    second.step()
    assert all(len(u.cache) == 2 for u in updates)
    del tr.pub, second
    gc.collect()
    assert all(len(u.cache) == 0 for u in updates)


def test_a_stepped_parameter_outside_the_model_is_named(tmp_path):
    model = torch.nn.ParameterDict({"a": torch.nn.Parameter(torch.zeros(4))})
    stray = torch.nn.Parameter(torch.zeros(3))
    pub = DeltaPublisher(model, torch.optim.AdamW([*model.parameters(), stray]), tmp_path, 10)
    pub.publish(0)
    model["a"].grad, stray.grad = torch.ones(4), torch.ones(3)
    with pytest.raises(PublisherConfigError, match="not in the model given to DeltaPublisher"):
        pub.step()


def test_differ_choices(tmp_path):
    assert Trainer(tmp_path / "a", differ="auto").pub.recorder.sink is None  # CPU weights: the torch reference
    model = tiny_qwen3()
    default = DeltaPublisher(model, torch.optim.AdamW(model.parameters()), tmp_path / "b", 3)
    assert default.differ == "auto" and default.recorder.sink is None  # CPU weights: the reference
    with pytest.raises(PublisherConfigError, match="differ must be"):
        Trainer(tmp_path / "c", differ="cuda")
    with pytest.raises(PublisherConfigError, match="change_capacity"):
        Trainer(tmp_path / "d", differ="triton", change_capacity=0.0)
    split = torch.nn.ParameterDict({"a": torch.nn.Parameter(torch.zeros(4)),
                                    "b": torch.nn.Parameter(torch.zeros(4, device="meta"))})
    opt = torch.optim.AdamW(split.parameters())
    with pytest.raises(PublisherConfigError, match="one device"):
        DeltaPublisher(split, opt, tmp_path / "e", 10, differ="triton")
    assert DeltaPublisher(split, opt, tmp_path / "f", 10, differ="auto").recorder.sink is None
    if os.environ.get("TRITON_INTERPRET") != "1":
        with pytest.raises(PublisherConfigError, match="differ='auto'"):
            Trainer(tmp_path / "g", differ="triton")


@pytest.mark.skipif(not KERNELS_RUN, reason="the diff kernels on CPU tensors need TRITON_INTERPRET=1")
def test_a_step_beyond_the_change_capacity_goes_out_full_and_the_chain_goes_on(tmp_path):
    tr = Trainer(tmp_path, interval=10, lr=1e-3, differ="triton", change_capacity=0.01)
    m0 = tr.pub.publish(0)
    tr.train_step()  # lr 1e-3 moves far more than 1 % of the bf16 weights
    assert tr.pub._overflow
    assert tr.pub.publish(1)["kind"] == "full"
    for group in tr.opt.param_groups:
        group["lr"] = 1e-6  # a step small enough for the sink
    tr.train_step()
    assert not tr.pub._overflow
    m2 = tr.pub.publish(2)
    assert m2["kind"] == "delta" and m2["base_step"] == 1
    cfg = engine_cfg(tr)
    engine, rx = make_receiver(tmp_path, cfg, m0)
    assert rx.load_latest().step == 2
    assert_same_params(engine, reference_engine(cfg, tr.wire_state()))


@pytest.mark.parametrize("field, value, problem", [
    ("interval", 0, "interval: must be >= 1"),
    ("rank", 2, "rank 2 outside world 2"),
    ("chunk_elements", 0, "chunk_elements: must be >= 1"),
    ("dense_fraction", 1.5, r"dense_fraction: must be in \(0, 1\]"),
    ("encoder", "tpu", "encoder must be auto, gpu or host"),
    ("coding", "zstd", "coding must be entropy or plain"),
    ("wire_dtype", torch.int8, "no wire format"),
    ("keep_anchors", 0, "keep_anchors: must be >= 1"),
    ("incarnation", 7, "incarnation: must be a string"),
    ("run_id", None, "every rank must be given the same run_id"),
])
def test_every_publisher_option_is_checked_when_the_config_is_made(field, value, problem):
    with pytest.raises(PublisherConfigError, match=problem):
        DeltaPublisherConfig(**{"world": 2, "run_id": "r", field: value})


def test_the_publisher_takes_its_options_from_one_config_and_refuses_unknown_ones(tmp_path):
    model = tiny_qwen3()
    opt = torch.optim.AdamW(model.parameters())
    cfg = DeltaPublisherConfig(interval=7, run_id="run-x", differ="torch")
    pub = DeltaPublisher(model, opt, tmp_path / "a", config=cfg)
    assert (pub.config, pub.interval, pub.run_id, pub.differ) == (cfg, 7, "run-x", "torch")
    assert DeltaPublisher(model, opt, tmp_path / "b", 3, config=cfg).interval == 3  # a shorthand overrides it
    with pytest.raises(PublisherConfigError, match="unknown option 'intervall'"):
        DeltaPublisher(model, opt, tmp_path / "c", intervall=3)


def _nan_step(tr, name, positions):
    # a real backward whose gradient is NaN at a few elements of one tensor: AdamW writes NaN exactly there
    ids = torch.randint(0, 128, (2, 16), generator=tr.gen)
    tr.model(input_ids=ids, labels=ids).loss.backward()
    grad = tr.model.get_parameter(name).grad.view(-1)
    grad[positions] = float("nan")
    tr.pub.step()
    tr.opt.zero_grad()


@pytest.mark.parametrize("differ", ["torch", pytest.param("triton", marks=pytest.mark.skipif(
    not KERNELS_RUN, reason="the diff kernels on CPU tensors need TRITON_INTERPRET=1"))])
def test_a_step_that_wrote_nan_is_refused_and_the_store_and_engine_keep_the_last_good_step(tmp_path, differ):
    tr = Trainer(tmp_path, interval=10, lr=1e-5, differ=differ, change_capacity=1.0)
    cfg = engine_cfg(tr)
    m0 = tr.pub.publish(0)
    engine, rx = make_receiver(tmp_path, cfg, m0)
    rx.apply(0)
    tr.train_step()
    assert tr.pub.publish(1)["kind"] == "delta"
    rx.apply(1)
    good_model = {k: v.clone() for k, v in tr.model.state_dict().items()}
    good_opt = copy.deepcopy(tr.opt.state_dict())
    files_before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    name = "model.layers.0.mlp.up_proj.weight"
    _nan_step(tr, name, [0, 7, 123])
    with pytest.raises(fmt.NonFiniteWeightsError) as err:
        tr.pub.publish(2)
    message = str(err.value)
    assert "step 2: 3 trainer weights in 1 tensors are NaN or infinite" in message
    assert f"{name} 3" in message and "the engines keep step 1" in message
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == files_before  # nothing written or removed
    assert BroadcastStore(tmp_path).complete_steps() == [0, 1]
    assert rx.load_latest().step == 1  # the engine stays on the last good step
    assert_same_params(engine, reference_engine(cfg, {k: v.detach() for k, v in good_model.items()}))
    with pytest.raises(fmt.NonFiniteWeightsError):  # refused again while the weights are not restored
        tr.pub.publish(2)
    tr.model.load_state_dict(good_model)
    tr.opt.load_state_dict(good_opt)
    m2 = tr.pub.publish(2)  # restored: a full checkpoint, the running checksums start again from it
    assert m2["kind"] == "full"
    assert rx.apply(2).action == "reload"
    tr.train_step()
    assert tr.pub.publish(3)["kind"] == "delta"
    rx.apply(3)
    assert_same_params(engine, reference_engine(cfg, tr.wire_state()))


def test_a_boot_checkpoint_with_an_infinite_weight_is_refused_before_the_store_changes(tmp_path):
    stale = tmp_path / fmt.step_dir_name(9)  # a step of an earlier timeline that a boot publish would remove
    stale.mkdir(parents=True)
    (stale / "rank-00000.delta").write_bytes(b"earlier")
    tr = Trainer(tmp_path)
    with torch.no_grad():
        tr.model.model.norm.weight[2] = float("inf")
        tr.model.lm_head.weight[0, :2] = float("-inf")
    with pytest.raises(fmt.NonFiniteWeightsError,
                       match="step 0: 3 trainer weights in 2 tensors .* the engines keep no step yet"):
        tr.pub.publish(0)
    assert [p.name for p in tmp_path.iterdir()] == [stale.name] and (stale / "rank-00000.delta").exists()


def test_a_frozen_tensor_turned_nan_is_refused_in_a_delta_and_published_once_restored(tmp_path):
    model = tiny_qwen3()
    frozen = model.model.norm.weight
    opt = torch.optim.AdamW([p for p in model.parameters() if p is not frozen], lr=1e-3)
    pub = DeltaPublisher(model, opt, tmp_path, interval=10, run_id="r", chunk_elements=500)
    pub.publish(0)
    ids = torch.randint(0, 128, (2, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    pub.step()
    kept = frozen.detach().clone()
    with torch.no_grad():
        frozen[4] = float("nan")
    with pytest.raises(fmt.NonFiniteWeightsError, match="step 1: 1 values of model.norm.weight .* keep step 0"):
        pub.publish(1)
    assert BroadcastStore(tmp_path).complete_steps() == [0]
    with torch.no_grad():
        frozen.copy_(kept)
    assert pub.publish(1)["kind"] == "delta"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float8_e5m2,
                                   torch.float8_e4m3fn])
def test_count_nonfinite_matches_isfinite_on_every_edge_value_of_each_wire_dtype(dtype):
    from rltune.sync.kernels.reference import as_bits, unsigned
    from rltune.sync.ops import count_nonfinite

    info = torch.finfo(dtype)
    values = torch.tensor([0.0, -0.0, 1.0, -1.0, info.max, -info.max, info.tiny, -info.tiny, info.tiny / 4,
                           info.eps, float("inf"), float("-inf"), float("nan"), -float("nan")])
    x = values.to(dtype)
    # every bit pattern of the 8- and 16-bit dtypes, the edge values of float32
    if x.element_size() <= 2:
        width = 8 * x.element_size()
        patterns = torch.arange(1 << width, dtype=torch.int32)
        patterns = torch.where(patterns >= 1 << (width - 1), patterns - (1 << width), patterns)
        x = patterns.to(torch.int8 if width == 8 else torch.int16).view(dtype)
    bits = as_bits(x)
    want = int((~torch.isfinite(x.float())).sum())
    assert want > 0
    assert int(count_nonfinite(bits, dtype)) == want
    assert int(count_nonfinite(unsigned(bits).to(torch.int32), dtype)) == want  # the sink's unsigned wire bits
    assert int(count_nonfinite(bits, torch.int32)) == 0  # a dtype that is not floating: nothing to count


@pytest.mark.skipif(not KERNELS_RUN, reason="the diff kernels on CPU tensors need TRITON_INTERPRET=1")
def test_the_sink_checks_each_change_with_its_own_wire_dtype(tmp_path):
    # fp32 and bf16 tensors in one step: ~1 in 256 finite fp32 changes have a low half that matches
    # bf16's 0x7F80, so reading a change in the wrong dtype refuses finite steps, and NaN fp32 bits
    # (0x7FC00000) read as bf16 pass; finite steps must stay deltas and a NaN in each dtype be counted
    model = tiny_qwen3()
    gen = torch.Generator().manual_seed(3)
    model.lm_head.float()  # 4096 fp32 elements, stepped in chunks of their own
    with torch.no_grad():  # fp32 values of their own (bf16 ones cast up have a zero low half)
        model.lm_head.weight.copy_(torch.randn(model.lm_head.weight.shape, generator=gen) * 0.02)
    model.model.norm.float()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    pub = DeltaPublisher(model, opt, tmp_path, interval=10, run_id="r", differ="triton", change_capacity=1.0,
                         chunk_elements=1000)
    assert pub.recorder.sink is not None

    def step(nan: bool) -> None:
        for p in model.parameters():
            p.grad = (torch.randn(p.shape, generator=gen) * 1e-2).to(p.dtype)
        if nan:
            model.lm_head.weight.grad[1, :2] = float("nan")  # fp32
            model.get_parameter("model.layers.1.mlp.down_proj.weight").grad[0, 5] = float("inf")  # bf16
        pub.step()
        opt.zero_grad()

    pub.publish(0)
    for s in (1, 2, 3):
        step(False)
        assert not pub._overflow
        assert pub.publish(s)["kind"] == "delta"
    fp32_changes = sum(e["changes"] for e in _entries(tmp_path, 3) if e["name"] == "lm_head.weight")
    assert fp32_changes > 3000  # ~12 of them match 0x7F80 in their low half
    step(True)
    assert pub._overflow
    with pytest.raises(fmt.NonFiniteWeightsError, match=r"step 4: 3 trainer weights in 2 tensors .*lm_head.weight 2"):
        pub.publish(4)


def test_a_refused_delta_keeps_the_frozen_changes_before_the_bad_tensor_for_the_next_publish(tmp_path):
    # two frozen tensors change; the later one (in publish order) turns NaN: the refusal must not take
    # in the earlier one's change, or the next publish would leave it out
    model = tiny_qwen3()
    first, later = model.model.layers[0].input_layernorm.weight, model.model.norm.weight
    opt = torch.optim.AdamW([p for p in model.parameters() if p is not first and p is not later], lr=1e-3)
    pub = DeltaPublisher(model, opt, tmp_path, interval=10, run_id="r", chunk_elements=500)
    assert {"model.layers.0.input_layernorm.weight", "model.norm.weight"} <= set(pub.static_names)
    m0 = pub.publish(0)
    ids = torch.randint(0, 128, (2, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    pub.step()
    kept = later.detach().clone()
    with torch.no_grad():
        first[:3] += 0.5
        later[1] = float("nan")
    with pytest.raises(fmt.NonFiniteWeightsError, match="model.norm.weight"):
        pub.publish(1)
    with torch.no_grad():
        later.copy_(kept)
    assert pub.publish(1)["kind"] == "delta"
    entry = next(e for e in _entries(tmp_path, 1) if e["name"] == "model.layers.0.input_layernorm.weight")
    assert entry["changes"] == 3
    cfg = engine_cfg(type("T", (), {"model": model})())
    engine, rx = make_receiver(tmp_path, cfg, m0)
    rx.apply(0)
    rx.apply(1)
    assert_same_params(engine, reference_engine(cfg, {k: v.detach() for k, v in model.state_dict().items()}))
