"""rltune.sync imports nothing above it; the bench harness trains the model its command hands it.

ARCHITECTURE.md: arrows point down, and ``sync`` imports nothing above it (the workload and the
frameworks' processes import sync, never the reverse). The walk below reads every import of every
module under rltune/sync, inside functions too, and relative ones resolved.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from rltune.sync.bench import (
    build_bench_model,
    load_sync_bench_config,
    resolve_preset,
    run_sync_bench,
    with_overrides,
)
from rltune.sync.bench.models import BENCH_MODELS, bench_model_config

REPO = Path(__file__).resolve().parents[2]
SYNC = REPO / "rltune" / "sync"
ABOVE = ("rltune.workload", "rltune.tune", "rltune.cli", "rltune.predict", "rltune.profile")


def _imports(source: str, module: str) -> list[tuple[int, str]]:
    """(line, module imported) of every import in ``source``, the module ``module`` (dotted), relative
    imports resolved; ``importlib.import_module("...")`` and ``__import__("...")`` with a literal count too."""
    package = module.rsplit(".", 1)[0] if not module.endswith("__init__") else module.removesuffix(".__init__")
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            out += [(node.lineno, f"{base}.{a.name}") for a in node.names] + [(node.lineno, base)]
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str) and ast.unparse(node.func) in ("importlib.import_module",
                                                                                       "import_module", "__import__"):
            out.append((node.lineno, node.args[0].value))
    return out


def _upward(source: str, module: str) -> list[str]:
    return [f"{module}:{line} imports {name}" for line, name in _imports(source, module)
            if any(name == a or name.startswith(a + ".") for a in ABOVE)]


def test_no_module_of_rltune_sync_imports_a_package_above_it():
    found, seen = [], 0
    for path in sorted(SYNC.rglob("*.py")):
        module = ".".join(path.relative_to(REPO).with_suffix("").parts)
        source = path.read_text()
        seen += len(_imports(source, module))
        found += _upward(source, module)
    assert seen > 200, f"the walk found only {seen} imports under rltune/sync"  # it read the modules it meant to
    assert not found, "rltune.sync must import nothing above it:\n" + "\n".join(found)


@pytest.mark.parametrize("source, module", [
    ("from rltune.workload.model import build_model", "rltune.sync.bench.run"),
    ("def f():\n    import rltune.tune.trial as t", "rltune.sync.receiver"),
    ("from ...cli import main", "rltune.sync.bench.run"),
    ("from ... import predict", "rltune.sync.vllm.worker"),
    ("import importlib\nimportlib.import_module('rltune.profile.adapters')", "rltune.sync.store"),
])
def test_the_walk_finds_each_way_of_importing_upward(source, module):
    assert len(_upward(source, module)) >= 1, source


def test_the_walk_lets_sync_import_sync_and_the_layers_below():
    source = "from . import format as fmt\nfrom ..kernels import reference\nimport rltune.contracts.schema\n" \
             "from rltune.errors import RltuneError"
    assert _upward(source, "rltune.sync.vllm.worker") == []
    assert ("rltune.sync.kernels.reference" in {n for _, n in _imports(source, "rltune.sync.vllm.worker")})


def test_the_bench_models_carry_the_reference_workloads_shapes_bit_for_bit():
    # models.py says tiny and small are the workload presets' shapes: records before and after compare
    from rltune.workload.model import build_model, model_config

    for name in ("tiny", "small"):
        assert bench_model_config(name).to_dict() == model_config(name).to_dict(), name
    ours, theirs = build_bench_model("tiny", 3, torch.bfloat16, "cpu"), build_model("tiny", 3, torch.bfloat16, "cpu")
    pa, pb = dict(ours.named_parameters()), dict(theirs.named_parameters())
    assert pa.keys() == pb.keys() and all(torch.equal(pa[n].view(torch.int16), pb[n].view(torch.int16)) for n in pa)
    assert torch.count_nonzero(pa["model.embed_tokens.weight"][0]) == 0  # pad id 0: its row starts at zero
    assert set(BENCH_MODELS) >= {"tiny", "small", "40m", "125m"}  # every model a sync or readers preset names


def test_the_harness_trains_the_model_its_command_hands_it(tmp_path):
    calls = []

    def handed(name, seed, dtype, device):
        calls.append((name, seed, dtype, str(device)))
        model = build_bench_model(name, seed, dtype, device)
        with torch.no_grad():
            model.lm_head.weight.zero_()  # a model the default builder would never make
        return model

    cfg = with_overrides(load_sync_bench_config(resolve_preset("cpu")), steps=1, warmup_steps=0,
                         transports=["inprocess"], device="cpu")
    result = run_sync_bench(cfg, tmp_path, build_model=handed)
    assert calls == [("tiny", cfg.seed, torch.bfloat16, "cpu")]
    assert result.all_verified
    assert result.record["model"]["params"] == sum(p.numel() for p in build_bench_model("tiny", 0, torch.bfloat16).parameters())
