"""``sync.transport: sparse_delta``: the workload's weight sync through rltune.sync.

Trainer side: :class:`rltune.sync.sender.DeltaPublisher` takes over the optimizer step (it diffs
each chunk as AdamW writes it) and publishes, per weight version, only the changed elements, with
a full anchor every ``sync.anchor_interval`` versions. Engine side: a
:class:`rltune.sync.receiver.DeltaReceiver` patches the engine's parameters in place and verifies
them against the trainer's checksums. The receiver is created at the engine's first update (its
first load reads the latest anchor and replays the deltas since; later ones apply one delta).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

_DTYPE_NAMES = {"float32": "float32", "bfloat16": "bfloat16"}


def _index_map_engine(preset: str, dtype: torch.dtype):
    """The engine's parameters (same names and shapes) as a module whose ``load_weights`` copies by name.

    IndexMap.record builds this with int64 placeholders; a transformers model cannot be cast to an
    integer dtype, so the structure comes from the meta device and the tensors are replaced.
    """
    import torch
    from transformers import Qwen3ForCausalLM

    from rltune.workload.model import model_config

    with torch.device("meta"):
        model = Qwen3ForCausalLM(model_config(preset))
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is not None:
                module._parameters[name] = torch.nn.Parameter(torch.empty(param.shape, dtype=dtype), requires_grad=False)
    named = dict(model.named_parameters())

    def load_weights(weights) -> None:
        for name, tensor in weights:
            named[name].data.copy_(tensor)

    model.load_weights = load_weights
    return model


class SparseDeltaLoader:
    """Engine side (picklable): builds its DeltaReceiver on the first update."""

    def __init__(self, root: Path, preset: str, spec: dict):
        self.root = Path(root)
        self.preset = preset
        self.spec = spec
        self.receiver = None

    def load(self, model, message: dict) -> dict[str, float]:
        from rltune.sync.indexmap import IndexMap
        from rltune.sync.receiver import DeltaReceiver

        if self.receiver is None:
            imap = IndexMap.record(lambda dt: _index_map_engine(self.preset, dt), self.spec)
            self.receiver = DeltaReceiver(self.root, model, imap)
            report = self.receiver.load_latest()
        else:
            report = self.receiver.apply(message["step"])
        if report.step != message["step"]:
            from rltune.workload.weight_sync import WeightSyncError

            raise WeightSyncError(f"{self.root}: engine reached broadcast step {report.step}, expected {message['step']}")
        return {"changes_applied": float(report.changes_applied), "reloaded": float(report.action == "reload"),
                "bytes": float(message.get("bytes", 0.0))}


class SparseDeltaPublisher:
    """Trainer side: publishes version 0 at start, then one delta (or anchor) per weight version."""

    name = "sparse_delta"

    def __init__(self, run_dir: Path, engine_dtype: torch.dtype, model, optimizer, preset: str, anchor_interval: int):
        import torch

        from rltune.sync.sender import DeltaPublisher

        self.root = Path(run_dir) / "broadcast"
        wire = engine_dtype if engine_dtype != next(model.parameters()).dtype else None
        self.publisher = DeltaPublisher(model, optimizer, self.root, anchor_interval, wire_dtype=wire,
                                        run_id="workload")
        manifest = self.publisher.publish(0)
        self.spec = {n: (t["shape"], t["dtype"]) for n, t in manifest["tensors"].items()}
        self.preset = preset
        self._torch = torch

    def optimizer_step(self) -> None:
        """Replaces ``optimizer.step()``: the publisher steps AdamW in chunks and records the changes."""
        self.publisher.step()

    def engine_loader(self) -> SparseDeltaLoader:
        return SparseDeltaLoader(self.root, self.preset, self.spec)

    def publish(self, model, version: int) -> tuple[dict, dict[str, float]]:
        manifest = self.publisher.publish(version)
        delta = sum(f["bytes"] for f in manifest["parts"])
        anchor = sum(f["bytes"] for f in manifest["anchors"])
        return ({"step": version, "bytes": float(delta + anchor)},
                {"bytes": float(delta + anchor), "delta_bytes": float(delta), "anchor_bytes": float(anchor)})

    def loaded(self, version: int) -> None:
        pass

    def close(self) -> None:
        pass
