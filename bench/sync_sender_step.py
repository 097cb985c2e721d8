"""Benchmark the trainer's optimizer step with the delta publisher: the torch reference diff against
the Triton diff/extract kernels, on the same model, data and AdamW steps, in one run.

Four copies of a ``rltune.workload.model`` preset (random init, bf16, same seed) each have their own
``torch.optim.AdamW``; three have a ``DeltaPublisher``: ``differ="torch"``, ``differ="triton"`` (with
fused AdamW the kernels step each update with the diff inside it) and ``differ="triton"`` with
``fuse_step=False`` ("staged": a copy before each update, the diff after it). Per step, one backward
on a random token batch gives the gradients, copied to every copy, whose weights must still be
bit-identical (the chunked step is exact); then
``publisher.step()`` (the chunked optimizer step with the diff inside it) is timed with CUDA events
around the host call, all publish, and their delta part files must be byte-identical (the run stops
otherwise). A plain ``optimizer.step()`` of the first copy is the baseline. Min/median/max over the
steps after ``--warmup`` go into the JSON record (device, versions, git SHA).

Usage (one GPU)::

    python bench/sync_sender_step.py --model small --steps 4 --out bench/results/sync_sender_step-h200.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sync_kernels import Timer  # noqa: E402  (bench/, beside this script)

from rltune.sync import format as fmt  # noqa: E402
from rltune.sync.bench import device_info, git_sha  # noqa: E402
from rltune.sync.sender import DEFAULT_CHUNK_ELEMENTS, DeltaPublisher  # noqa: E402
from rltune.workload.model import build_model, resolve_device  # noqa: E402


def stats(values: list[float]) -> dict[str, float]:
    return dict(min_ms=1e3 * min(values), median_ms=1e3 * statistics.median(values), max_ms=1e3 * max(values))


def profile_step(step, path: Path) -> None:
    """Run ``step`` once under torch.profiler and cProfile; write its ops by host and by device time, and
    its Python functions by cumulative time (where host time goes outside torch's ops)."""
    import cProfile
    import io
    import pstats

    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    python = cProfile.Profile()
    with profile(activities=activities) as prof:
        python.enable()
        step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        python.disable()
    table = prof.key_averages()
    functions = io.StringIO()
    pstats.Stats(python, stream=functions).sort_stats("cumulative").print_stats(45)
    text = ("by host time\n" + table.table(sort_by="self_cpu_time_total", row_limit=40)
            + "\nby device time\n" + table.table(sort_by="self_device_time_total", row_limit=25)
            + "\nPython functions by cumulative time\n" + functions.getvalue())
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=["tiny", "small"], default="small")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--chunk-elements", type=int, default=DEFAULT_CHUNK_ELEMENTS,
                        help="elements per optimizer-step chunk (the diff hook's granularity)")
    parser.add_argument("--adamw", choices=["foreach", "fused", "loop"], default="foreach",
                        help="torch AdamW's implementation (foreach: its default on a GPU; loop: foreach=False)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--profile", type=Path, default=None,
                        help="also run one more step and write where the kernels arm's time went in it (torch "
                             "ops by host and device time, Python functions by cumulative time) to this file")
    args = parser.parse_args(argv)
    device = torch.device(resolve_device(args.device))
    with tempfile.TemporaryDirectory() as tmp:
        arms: dict[str, tuple] = {}
        for name in ("plain", "torch", "triton", "staged"):
            model = build_model(args.model, 0, torch.bfloat16, device)
            opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01,
                                    fused=args.adamw == "fused" or None, foreach=args.adamw == "foreach")
            pub = None
            if name != "plain":
                pub = DeltaPublisher(model, opt, Path(tmp) / name, interval=10**6, run_id="sync-sender-step",
                                     incarnation="bench",  # the same attempt ids, so the arms' parts compare byte for byte
                                     differ="triton" if name == "staged" else name, change_capacity=0.25,
                                     chunk_elements=args.chunk_elements, fuse_step=name != "staged")
                pub.publish(0)
            arms[name] = (model, opt, pub)
        once = Timer(device, warmup=0, repeats=1)  # each step runs exactly once
        gen = torch.Generator(device=device).manual_seed(1)
        vocab = arms["plain"][0].config.vocab_size
        times: dict[str, list[float]] = {n: [] for n in arms}
        changes = []
        for step in range(1, args.warmup + args.steps + 1 + (args.profile is not None)):
            ids = torch.randint(0, vocab, (args.batch, args.seq_len), generator=gen, device=device)
            # One backward, its gradients copied to every arm: CUDA backward kernels that add with
            # atomics (the embedding's) give slightly different gradients from run to run.
            plain = list(arms["plain"][0].parameters())
            loss = arms["plain"][0](input_ids=ids, labels=ids).loss
            loss.backward()
            loss = loss.detach()
            nonfinite_grads = torch.stack([(~q.grad.isfinite()).sum() for q in plain if q.grad is not None]).sum()
            for name, (model, _, _) in arms.items():
                for p, q in zip(model.parameters(), plain, strict=True):
                    if not torch.equal(p.view(torch.int16), q.view(torch.int16)):
                        raise SystemExit(f"step {step}: the {name} arm's weights left the plain step's")
                    if p is not q:
                        p.grad = q.grad.clone()
            for name, (_, opt, pub) in arms.items():
                run = opt.step if pub is None else pub.step
                if step > args.warmup + args.steps:  # the profiled step, untimed: the profiler's cost is its own
                    if name == "triton":
                        profile_step(run, args.profile)
                    else:
                        run()
                    opt.zero_grad(set_to_none=True)
                    continue
                seconds = once(run)["median_ms"] / 1e3
                opt.zero_grad(set_to_none=True)
                if step > args.warmup:
                    times[name].append(seconds)
            parts = {}
            overflowed = {name: arms[name][2]._overflow for name in ("torch", "triton", "staged")}
            for name in ("torch", "triton", "staged"):
                try:
                    kind = arms[name][2].publish(step)["kind"]
                except fmt.NonFiniteWeightsError as exc:
                    raise SystemExit(f"the {name} publisher refused the step ({exc}); the step's loss was "
                                     f"{float(loss):.4g} and its backward left {int(nonfinite_grads)} gradients "
                                     "NaN or infinite: run fewer steps or a lower --lr") from None
                step_dir = Path(tmp) / name / fmt.step_dir_name(step)
                parts[name] = (kind, {p.name: p.read_bytes() for p in sorted(step_dir.glob("rank-*"))})
            kinds = {name: (kind, "overflowed" if overflowed[name] else "") for name, (kind, _) in parts.items()}
            if parts["staged"] != parts["triton"]:
                raise SystemExit(f"step {step}: the staged and the fused kernels published different parts ({kinds})")
            if parts["torch"][0] != parts["triton"][0]:
                # NaN steps are refused above: this is a count of the kernels' sink against the torch differ's
                torch_changes = (sum(e["changes"] for e in fmt.read_part_header(
                    Path(tmp) / "torch" / fmt.step_dir_name(step) / "rank-00000.delta")[0]["entries"])
                    if parts["torch"][0] == "delta" else None)
                raise SystemExit(f"step {step}: the differs published different kinds of parts ({kinds}); the torch "
                                 f"differ's delta holds {torch_changes} changes")
            if parts["torch"] != parts["triton"]:
                heads = {n: fmt.read_part_header(Path(tmp) / n / fmt.step_dir_name(step) / "rank-00000.delta")[0]
                         for n in ("torch", "triton")}
                odd = [(a["name"], a["changes"], b["changes"])
                       for a, b in zip(heads["torch"]["entries"], heads["triton"]["entries"], strict=False)
                       if a != b]
                raise SystemExit(f"step {step}: the two differs published different parts; entries "
                                 f"(name, torch changes, triton changes) that differ: {odd[:5]}")
            if parts["triton"][0] != "delta":
                raise SystemExit(f"step {step}: published {kinds}, not a delta; lower --lr")
            header, _ = fmt.read_part_header(Path(tmp) / "triton" / fmt.step_dir_name(step) / "rank-00000.delta")
            changes.append(sum(e["changes"] for e in header["entries"]))
            print(f"step {step}: " + ", ".join(f"{n} {1e3 * v[-1]:.1f} ms" for n, v in times.items() if v)
                  + f"; {changes[-1]} changes, deltas identical", flush=True)
    params = sum(p.numel() for p in arms["plain"][0].parameters())
    sink = arms["triton"][2].recorder.sink
    record = dict(benchmark="sync_sender_step", git_sha=git_sha(), device=device_info(str(device)), model=args.model,
                  params=params, chunk_elements=args.chunk_elements, adamw=args.adamw, lr=args.lr,
                  batch=args.batch, seq_len=args.seq_len, steps=args.steps,
                  warmup=args.warmup, changes_per_step=changes[args.warmup:args.warmup + args.steps],
                  plain_step=stats(times["plain"]), step_torch_differ=stats(times["torch"]),
                  step_triton_differ=stats(times["triton"]), step_triton_staged=stats(times["staged"]),
                  fused_step=bool(sink is not None and sink.fuse_adamw),
                  deltas_identical=True)
    record["extra_ms_torch_differ"] = record["step_torch_differ"]["median_ms"] - record["plain_step"]["median_ms"]
    record["extra_ms_triton_differ"] = record["step_triton_differ"]["median_ms"] - record["plain_step"]["median_ms"]
    record["extra_ms_triton_staged"] = record["step_triton_staged"]["median_ms"] - record["plain_step"]["median_ms"]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1), encoding="utf-8")
    print(json.dumps({k: record[k] for k in ("plain_step", "step_torch_differ", "step_triton_differ",
                                             "step_triton_staged", "extra_ms_torch_differ", "extra_ms_triton_differ",
                                             "extra_ms_triton_staged")}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
