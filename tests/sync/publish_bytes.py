"""Publish a fixed set of training runs and keep every file they write, to compare two versions of the sender.

Each scenario trains a tiny real Qwen3 (fixed seed, fixed token batches) for six optimizer steps through
``DeltaPublisher`` with an anchor every 3 steps and fixed run id and incarnation, so two versions of
``rltune.sync`` that record and publish the same changes write byte-identical broadcast roots (deltas,
anchors, manifests, markers). The scenarios cover both differs, world 1 and 2, fp32 master weights sent
as bf16, fused AdamW stepped by the kernels, SignSGD, tied and frozen tensors, a step beyond the change
capacity (published full) and a dense step (published full).

Per scenario it also counts, during ``publish.step()`` only, the change-sink calls and the aten
operations dispatched (a tensor allocation or copy, a host read such as ``item``): two versions that do
the same work per step give the same counts.

Usage (run once per version, then compare)::

    TRITON_INTERPRET=1 PYTHONPATH=<checkout> python tests/sync/publish_bytes.py run OUT_DIR
    python tests/sync/publish_bytes.py compare OUT_A OUT_B
"""

from __future__ import annotations

import argparse
import collections
import filecmp
import json
import os
import sys
from pathlib import Path

STEPS = 6
INTERVAL = 3
# aten operations whose count varies from run to run of one version: compared, but not counted as a difference
NOISY = {"aten.lift_fresh": "torch.tensor() of a fused AdamW plan, remade when a step's gradients land at new "
                            "addresses (the allocator's choice)"}


def tiny_qwen3(dtype, tie=False, seed=0):
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
                      tie_word_embeddings=tie)
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(cfg).to(dtype)


def scenarios() -> dict[str, dict]:
    import torch

    out = {}
    for differ in ("torch", "triton"):
        for world in (1, 2):
            out[f"adamw-fp32-bf16wire-{differ}-w{world}"] = dict(
                differ=differ, world=world, dtype=torch.float32, wire_dtype=torch.bfloat16, lr=1e-4)
            out[f"adamw-bf16-{differ}-w{world}"] = dict(differ=differ, world=world, dtype=torch.bfloat16, lr=1e-5)
        out[f"signsgd-fp32-bf16wire-{differ}-w2"] = dict(differ=differ, world=2, dtype=torch.float32,
                                                         wire_dtype=torch.bfloat16, optimizer="signsgd", lr=1e-3)
        out[f"tied-frozen-{differ}-w2"] = dict(differ=differ, world=2, dtype=torch.bfloat16, lr=1e-5, tie=True,
                                               frozen=True)
        out[f"dense-{differ}-w1"] = dict(differ=differ, world=1, dtype=torch.bfloat16, lr=1e-5, dense_fraction=0.25,
                                         lrs={2: 1e-1, 5: 1e-1})
    for world in (1, 2):  # fused AdamW, stepped by the kernels where an update is all this rank's
        out[f"fused-adamw-bf16-triton-w{world}"] = dict(differ="triton", world=world, dtype=torch.bfloat16, lr=1e-5,
                                                        fused=True, fuse=True)
        out[f"fused-adamw-fp32-bf16wire-triton-w{world}"] = dict(
            differ="triton", world=world, dtype=torch.float32, wire_dtype=torch.bfloat16, lr=1e-4, fused=True,
            fuse=True)
    out["overflow-triton-w1"] = dict(differ="triton", world=1, dtype=torch.bfloat16, lr=1e-6, change_capacity=0.01,
                                     lrs={2: 1e-3, 4: 1e-3})
    return out


def sink_of(pub):
    recorder = getattr(pub, "recorder", None)
    return recorder.sink if recorder is not None else pub._sink


class Counts:
    """Change-sink calls and aten operations while a publisher steps."""

    SINK_METHODS = ("reset", "group", "stage", "append_staged", "adamw_append", "append", "finish", "collect",
                    "collect_spans", "step_changes")

    def __init__(self):
        self.sink = collections.Counter()
        self.ops = collections.Counter()
        self.active = False

    def install(self):
        from rltune.sync.kernels import ChangeSink

        for name in self.SINK_METHODS:
            original = getattr(ChangeSink, name)

            def wrapped(sink, *args, _original=original, _name=name, **kwargs):
                if self.active:
                    self.sink[_name] += 1
                return _original(sink, *args, **kwargs)
            setattr(ChangeSink, name, wrapped)

    def mode(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        counts = self

        class Ops(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                counts.ops[str(func.overloadpacket)] += 1
                return func(*args, **(kwargs or {}))
        return Ops()


def run_scenario(root: Path, spec: dict, counts: Counts) -> list[str]:
    import torch

    from rltune.sync.sender import DeltaPublisher, SignSGD

    world = spec["world"]
    trainers = []
    for rank in reversed(range(world)):  # the last rank first: rank 0 finalizes once every part is there
        model = tiny_qwen3(spec["dtype"], tie=spec.get("tie", False))
        frozen = model.model.norm.weight if spec.get("frozen") else None
        params = [p for p in model.parameters() if p is not frozen]
        if spec.get("optimizer") == "signsgd":
            opt = SignSGD(params, lr=spec["lr"], weight_decay=0.01)
        else:
            opt = torch.optim.AdamW(params, lr=spec["lr"], weight_decay=0.01, fused=spec.get("fused"))
        options = {k: spec[k] for k in ("wire_dtype", "dense_fraction") if k in spec}
        pub = DeltaPublisher(model, opt, root, INTERVAL, rank=rank, world=world, run_id="bytes", incarnation="fixed",
                             chunk_elements=1000, differ=spec["differ"],
                             change_capacity=spec.get("change_capacity", 1.0), **options)
        if spec.get("fuse"):
            sink_of(pub).fuse_adamw = True  # on CPU weights the fused step is off unless asked for
        trainers.append((model, opt, pub, frozen, torch.Generator().manual_seed(1)))
    kinds = []
    for _, _, pub, _, _ in trainers:
        m = pub.publish(0)
    kinds.append(m["kind"])
    for step in range(1, STEPS + 1):
        for model, opt, pub, frozen, gen in trainers:
            for group in opt.param_groups:
                group["lr"] = spec.get("lrs", {}).get(step, spec["lr"])
            ids = torch.randint(0, 128, (2, 16), generator=gen)
            model(input_ids=ids, labels=ids).loss.backward()
            counts.active = True
            with counts.mode():
                pub.step()
            counts.active = False
            opt.zero_grad()
            if frozen is not None and step % 2 == 0:
                with torch.no_grad():
                    frozen[step:step + 3] += 0.5  # a tensor no optimizer steps, changed outside it
            m = pub.publish(step)
        kinds.append(m["kind"])
    return kinds


def run(out: Path, only: str | None = None) -> None:
    counts = Counts()
    counts.install()
    summary = {}
    for name, spec in scenarios().items():
        if only is not None and only not in name:
            continue
        counts.sink.clear()
        counts.ops.clear()
        kinds = run_scenario(out / name, spec, counts)
        files = sorted(str(p.relative_to(out / name)) for p in (out / name).rglob("*") if p.is_file())
        summary[name] = dict(kinds=kinds, files=len(files), sink_calls=dict(sorted(counts.sink.items())),
                             aten_ops=dict(sorted(counts.ops.items())))
        print(f"{name}: kinds {kinds}, {len(files)} files, sink calls {dict(counts.sink)}, "
              f"{sum(counts.ops.values())} aten ops", flush=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=1), encoding="utf-8")


def compare(a: Path, b: Path) -> int:
    files_a = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file() and p.name != "summary.json")
    files_b = sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file() and p.name != "summary.json")
    bad = 0
    if files_a != files_b:
        print(f"different file sets: only in {a}: {sorted(set(files_a) - set(files_b))[:10]}, only in {b}: "
              f"{sorted(set(files_b) - set(files_a))[:10]}")
        bad += 1
    same = 0
    for rel in sorted(set(files_a) & set(files_b)):
        if filecmp.cmp(a / rel, b / rel, shallow=False):
            same += 1
        else:
            print(f"differs: {rel}")
            bad += 1
    kinds = collections.Counter()
    for rel in files_a:
        kinds[rel.name.split(".")[-1] if "." in rel.name else rel.name] += 1
    print(f"{same} of {len(files_a)} files byte-identical ({dict(sorted(kinds.items()))})")
    sa = json.loads((a / "summary.json").read_text(encoding="utf-8"))
    sb = json.loads((b / "summary.json").read_text(encoding="utf-8"))
    if sa.keys() != sb.keys():
        print(f"different scenarios: {sorted(sa)} and {sorted(sb)}")
        bad += 1
    noise = collections.Counter()
    for name in sorted(sa.keys() & sb.keys()):
        if sa[name]["kinds"] != sb[name]["kinds"]:
            print(f"{name}: kinds differ: {sa[name]['kinds']} and {sb[name]['kinds']}")
            bad += 1
        for key in ("sink_calls", "aten_ops"):
            x, y = sa[name][key], sb[name][key]
            diff = {k: (x.get(k), y.get(k)) for k in sorted(set(x) | set(y)) if x.get(k) != y.get(k)}
            for k in [k for k in diff if k in NOISY]:
                noise[k] += 1
                del diff[k]
            if diff:
                print(f"{name}: {key} differ: {diff}")
                bad += 1
    for k, n in noise.items():
        print(f"{k} differs in {n} scenarios, as it does between two runs of one version: {NOISY[k]}")
    print(f"{len(sa)} scenarios: kinds, sink calls and aten operations in the step "
          f"{'the same' if not bad else 'differ as listed'}")
    return 1 if bad else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    runner = sub.add_parser("run")
    runner.add_argument("out", type=Path)
    runner.add_argument("--only", help="the scenarios whose name holds this string")
    cmp = sub.add_parser("compare")
    cmp.add_argument("a", type=Path)
    cmp.add_argument("b", type=Path)
    args = parser.parse_args(argv)
    if args.cmd == "run":
        if os.environ.get("TRITON_INTERPRET") != "1":
            sys.exit("set TRITON_INTERPRET=1 (the triton differ on CPU weights)")
        if args.out.exists() and any(args.out.iterdir()):
            sys.exit(f"{args.out} is not empty")
        run(args.out, args.only)
        return 0
    return compare(args.a, args.b)


if __name__ == "__main__":
    raise SystemExit(main())
