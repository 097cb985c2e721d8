"""The broadcast root on disk: step directories, completion, chains and pruning.

The trainer writes through :func:`write_rank_files` (each rank its own files, no gather) and
:func:`finalize_step` (rank 0: manifest, then the COMPLETE marker last); :func:`prune_before`
removes an old chain. Engines read through :class:`BroadcastStore`, which only ever trusts steps
with a valid marker and re-lists a directory before concluding that a step is absent (an NFS
lookup cache can otherwise hide a step that exists, turning a delta step into a full reload).

Example::

    store = BroadcastStore("/shared/broadcast")
    if store.is_complete(42):
        manifest = store.manifest(42)
        anchor, deltas = store.chain(42)      # anchor step to load, delta steps to replay after it
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

from rltune.sync import format as fmt


def write_rank_files(step_dir: Path, rank: int, files: dict[str, bytes], summary: dict[str, Any]) -> None:
    """Write one trainer rank's part files, then its summary (which says they are all there)."""
    step_dir.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        fmt.write_atomic(step_dir / name, data)
    fmt.write_atomic(step_dir / f"rank-{rank:05d}.json", json.dumps(summary).encode())


def finalize_step(step_dir: Path, manifest_base: dict[str, Any], world: int, timeout_s: float = 600.0) -> dict[str, Any]:
    """Rank 0: wait for every rank's summary, sum checksum shares, write manifest and COMPLETE.

    ``manifest_base`` holds run_id, step, kind, base_step, world and tensors (dtype, shape,
    tied_to; checksum filled here from the ranks' shares, mod 2^64).
    """
    deadline = time.monotonic() + timeout_s
    summaries = []
    for rank in range(world):
        path = step_dir / f"rank-{rank:05d}.json"
        while not path.exists():
            if time.monotonic() > deadline:
                raise fmt.ChainError(f"{path}: trainer rank {rank} did not finish its part within {timeout_s:.0f} s")
            time.sleep(0.01)
            os.listdir(step_dir)  # revalidate the directory (NFS)
        summaries.append(json.loads(path.read_bytes()))
    manifest = dict(manifest_base)
    tensors = {name: dict(t) for name, t in manifest["tensors"].items()}
    for name in tensors:
        total = 0
        for s in summaries:
            total += int(s["checksums"].get(name, "0"))
        tensors[name]["checksum"] = str(total % (1 << 64))
    manifest["tensors"] = tensors
    manifest["parts"] = sorted((f for s in summaries for f in s["files"] if f["file"].endswith(".delta")),
                               key=lambda f: f["rank"])
    manifest["anchors"] = sorted((f for s in summaries for f in s["files"] if f["file"].endswith(".anchor")),
                                 key=lambda f: f["rank"])
    manifest["format_version"] = fmt.FORMAT_VERSION
    fmt.write_manifest(step_dir, manifest)
    return manifest


def prune_before(root: Path, step: int) -> list[int]:
    """Remove every step directory below ``step``; its marker first, so no reader trusts a half-removed step."""
    removed = []
    for name in sorted(os.listdir(root)):
        s = fmt.parse_step_dir_name(name)
        if s is not None and s < step:
            d = Path(root) / name
            try:
                (d / fmt.COMPLETE_NAME).unlink()
            except FileNotFoundError:
                pass
            shutil.rmtree(d, ignore_errors=True)
            removed.append(s)
    return removed


class BroadcastStore:
    """Read side of a broadcast root. Manifests of complete steps are immutable, so they are cached."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)
        self._listing: set[int] | None = None
        self._manifests: dict[int, dict[str, Any]] = {}

    def step_dir(self, step: int) -> Path:
        return self.root / fmt.step_dir_name(step)

    def _relist(self) -> set[int]:
        # os.stat then os.listdir on the directory forces an NFS client to revalidate its entries.
        os.stat(self.root)
        self._listing = {s for s in (fmt.parse_step_dir_name(n) for n in os.listdir(self.root)) if s is not None}
        return self._listing

    def steps(self, revalidate: bool = True) -> list[int]:
        """Step directories present (complete or not), ascending."""
        if revalidate or self._listing is None:
            self._relist()
        return sorted(self._listing)

    def is_complete(self, step: int) -> bool:
        """True when step's COMPLETE marker exists; re-lists before answering no."""
        listing = self._listing if self._listing is not None else self._relist()
        if step not in listing:
            listing = self._relist()
            if step not in listing:
                return False
        d = self.step_dir(step)
        try:
            os.listdir(d)  # revalidate the step directory itself before probing its marker
        except FileNotFoundError:
            return False
        return (d / fmt.COMPLETE_NAME).exists()

    def complete_steps(self) -> list[int]:
        return [s for s in self.steps(revalidate=True) if self.is_complete(s)]

    def manifest(self, step: int) -> dict[str, Any]:
        if not self.is_complete(step):  # checked even when cached: a pruned step must not be trusted
            self._manifests.pop(step, None)
            raise fmt.ChainError(f"{self.step_dir(step)}: step {step} is absent or not complete; "
                                 "wait for the trainer or load an older anchor")
        if step not in self._manifests:
            self._manifests[step] = fmt.read_manifest(self.step_dir(step))
        return self._manifests[step]

    def forget(self, step: int) -> None:
        """Drop a cached manifest (after a read error, so a rewrite of the step is seen)."""
        self._manifests.pop(step, None)

    def latest_loadable(self, at_most: int | None = None) -> int | None:
        """Latest complete step with anchor slices (kind anchor or full) at or below ``at_most``."""
        for s in reversed(self.complete_steps()):
            if (at_most is None or s <= at_most) and self.manifest(s)["kind"] != "delta":
                return s
        return None

    def chain(self, target: int) -> tuple[int, list[int]]:
        """(anchor step to load, delta steps to apply after it) that reach ``target``.

        Follows ``base_step`` links back from the target, so no delta can be skipped; every step on
        the way must be complete and of the same run.
        """
        m = self.manifest(target)
        run_id, deltas, step = m["run_id"], [], target
        while m["kind"] == "delta":
            deltas.append(step)
            step = m["base_step"]
            try:
                m = self.manifest(step)
            except fmt.ChainError:
                raise fmt.ChainError(f"{self.step_dir(step)}: base of the chain to step {target} is gone "
                                     "(pruned or never written); load a newer anchor") from None
            if m["run_id"] != run_id:
                raise fmt.ChainError(f"{self.step_dir(step)}: run_id {m['run_id']!r} differs from step "
                                     f"{target}'s {run_id!r}; the chain crosses a trainer restart")
        return step, deltas[::-1]
