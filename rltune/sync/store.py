"""The broadcast root on disk: step directories, completion, chains and pruning.

The trainer writes through :func:`clean_leftovers` (what an earlier attempt of the step left),
:func:`write_rank_files` (each rank its own files, no gather) and :func:`finalize_step` (rank 0:
manifest, then the COMPLETE marker last); :func:`prune_before` removes an old chain and
:func:`remove_after` a timeline a resumed trainer no longer continues. Engines read through
:class:`BroadcastStore`, which only ever trusts steps with a valid marker, re-lists a directory
before concluding that a step is absent (an NFS lookup cache can otherwise hide a step that exists,
turning a delta step into a full reload), keys every cached manifest by the marker bytes that
describe it (a step republished under a new attempt is read again, never verified against the old
one's checksums) and waits for a step that is not there yet with a polite, capped back-off.

Every publish of a step has an **attempt** id (docs/delta-format.md): rank summaries, part headers,
the manifest and the marker all carry it, so nothing one attempt left is taken for another's.

Example::

    store = BroadcastStore("/shared/broadcast")
    store.wait_complete(42, timeout_s=30)      # back-off polls until the trainer's marker is there
    manifest = store.manifest(42)
    anchor, deltas = store.chain(42)          # anchor step to load, delta steps to apply after it
    for anchor, deltas in store.chains(42):   # newest anchor first, then older ones to fall back to
        ...
"""

from __future__ import annotations

import json
import os
import random
import shutil
import time
from pathlib import Path
from typing import Any

from rltune.sync import format as fmt
from rltune.sync.kernels.reference import MASK64, checksum2_add

SUMMARY_KEYS = {"rank", "attempt", "checksums", "checksums2", "files"}


def summary_name(rank: int) -> str:
    return f"rank-{rank:05d}.json"


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass
    except IsADirectoryError:
        shutil.rmtree(path, ignore_errors=True)


def clean_leftovers(step_dir: Path, rank: int, attempt: str, world: int) -> list[str]:
    """Before ``rank`` writes ``attempt``'s files of a step: remove what another attempt left there.

    A marker of another attempt goes first (readers stop trusting the old step before any of its
    files change), then this rank's summary, parts and temporary files; rank 0 also removes the
    old manifest and the files of ranks at or above ``world``. Returns the names removed.
    """
    step_dir = Path(step_dir)
    try:
        names = os.listdir(step_dir)
    except FileNotFoundError:
        return []
    except NotADirectoryError:
        _unlink(step_dir)
        return [step_dir.name]
    removed = []
    marker = step_dir / fmt.COMPLETE_NAME
    if fmt.COMPLETE_NAME in names:
        try:
            _, fields = fmt.read_marker(step_dir)
            stale = fields["attempt"] != attempt
        except fmt.SyncFormatError:
            stale = True
        if stale:
            _unlink(marker)
            removed.append(fmt.COMPLETE_NAME)
    mine = f"rank-{rank:05d}."
    for name in names:
        if name == fmt.COMPLETE_NAME:
            continue
        bare = name[1:] if name.startswith(".") else name
        owner = _rank_of(bare)
        ours = bare.startswith(mine) or (rank == 0 and (owner is None or owner >= world))
        if not ours:
            continue
        if name.startswith(".") and ".tmp" in name:
            _unlink(step_dir / name)  # a temporary file of a write that died
            removed.append(name)
        elif name == summary_name(rank) or (rank == 0 and owner is not None and owner >= world):
            _unlink(step_dir / name)
            removed.append(name)
        elif name.startswith(mine) and fmt.PART_FILE_RE.match(name):
            _unlink(step_dir / name)
            removed.append(name)
        elif rank == 0 and name == fmt.MANIFEST_NAME:
            _unlink(step_dir / name)
            removed.append(name)
    return removed


def _rank_of(name: str) -> int | None:
    if name.startswith("rank-") and name[5:10].isdigit():
        return int(name[5:10])
    return None


def write_rank_files(step_dir: Path, rank: int, files: dict[str, bytes | list[bytes | memoryview]], summary: dict[str, Any]) -> None:
    """Write one trainer rank's part files, then its summary (which says they are all there)."""
    step_dir.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        fmt.write_atomic(step_dir / name, data)
    fmt.write_atomic(step_dir / summary_name(rank), json.dumps(summary).encode())


def _read_summary(step_dir: Path, rank: int, attempt: str, world: int, step: int) -> dict[str, Any] | None:
    """Rank ``rank``'s summary of ``attempt``, checked against the headers of the parts it lists;
    None while the summary there is absent or another attempt's (a leftover of one that died)."""
    path = step_dir / summary_name(rank)
    try:
        with fmt.open_regular(path, "rank summary", fmt.MissingPartError) as f:
            raw = f.read(fmt.MAX_MANIFEST_BYTES + 1)
    except (fmt.MissingPartError, OSError):
        return None  # absent, or nothing a rank writes (a directory, a pipe): waited past until ours is there
    try:
        summary = fmt.parse_json(raw, str(path), "rank summary")
    except fmt.ManifestSchemaError:
        return None  # not of this attempt: ours are written whole, by rename
    if not isinstance(summary, dict) or summary.get("attempt") != attempt:
        return None
    if set(summary) != SUMMARY_KEYS or summary["rank"] != rank or not isinstance(summary["files"], list) \
            or not isinstance(summary["checksums"], dict) or not isinstance(summary["checksums2"], dict):
        raise fmt.ManifestSchemaError(f"{path}: rank summary of attempt {attempt} has keys {sorted(summary)}, "
                                      f"expected {sorted(SUMMARY_KEYS)}; two trainers write to one broadcast root?")
    for f in summary["files"]:
        header, _ = fmt.read_part_header(fmt.safe_child(step_dir, f["file"]), expect_bytes=f["bytes"])
        if header["attempt"] != attempt or header["rank"] != rank or header["step"] != step \
                or header["world"] != world:
            raise fmt.WrongStepError(f"{step_dir / f['file']}: written by attempt {header['attempt']} rank "
                                     f"{header['rank']}, but rank {rank}'s summary of attempt {attempt} lists it; two "
                                     "trainers write to one broadcast root?")
    return summary


def finalize_step(step_dir: Path, manifest_base: dict[str, Any], world: int, timeout_s: float = 600.0
                  ) -> dict[str, Any]:
    """Rank 0: wait for every rank's summary of this attempt, sum checksum shares, write manifest and COMPLETE.

    ``manifest_base`` holds run_id, attempt, step, kind, base_step, base_attempt, world and tensors
    (dtype, shape, tied_to; both checksums filled here from the ranks' shares). A summary another
    attempt left is never taken: it is waited past until this attempt's replaces it.
    """
    deadline = time.monotonic() + timeout_s
    attempt, step = manifest_base["attempt"], manifest_base["step"]
    summaries = []
    delay = 0.005
    for rank in range(world):
        while (summary := _read_summary(step_dir, rank, attempt, world, step)) is None:
            if time.monotonic() > deadline:
                raise fmt.ChainError(f"{step_dir / summary_name(rank)}: trainer rank {rank} did not finish its part "
                                     f"of attempt {attempt} within {timeout_s:.0f} s")
            time.sleep(delay)
            delay = min(0.2, delay * 1.5)
            os.listdir(step_dir)  # revalidate the directory (NFS)
        summaries.append(summary)
    manifest = dict(manifest_base)
    tensors = {name: dict(t) for name, t in manifest["tensors"].items()}
    for name in tensors:
        total, total2 = 0, 0
        for s in summaries:
            total += int(s["checksums"].get(name, "0"))
            total2 = checksum2_add(total2, int(s["checksums2"].get(name, "0")))
        tensors[name]["checksum"] = str(total & MASK64)
        tensors[name]["checksum2"] = str(total2)
    manifest["tensors"] = tensors
    manifest["parts"] = sorted((f for s in summaries for f in s["files"] if f["file"].endswith(".delta")),
                               key=lambda f: f["rank"])
    manifest["anchors"] = sorted((f for s in summaries for f in s["files"] if f["file"].endswith(".anchor")),
                                 key=lambda f: f["rank"])
    manifest["format_version"] = fmt.FORMAT_VERSION
    fmt.write_manifest(step_dir, manifest)
    return manifest


def _remove_step(d: Path) -> None:
    # the marker first, so no reader trusts a half-removed step
    _unlink(d / fmt.COMPLETE_NAME)
    shutil.rmtree(d, ignore_errors=True)
    if d.is_symlink():
        d.unlink()


def prune_before(root: Path, step: int) -> list[int]:
    """Remove every step directory below ``step``; its marker first, so no reader trusts a half-removed step."""
    removed = []
    for name in sorted(os.listdir(root)):
        s = fmt.parse_step_dir_name(name)
        if s is not None and s < step:
            _remove_step(Path(root) / name)
            removed.append(s)
    return removed


def remove_after(root: Path, step: int) -> list[int]:
    """Remove every step directory above ``step`` (markers first): the steps of a timeline that a
    trainer resumed at ``step`` no longer continues, which a reader must not load as its latest."""
    removed = []
    for name in sorted(os.listdir(root), reverse=True):
        s = fmt.parse_step_dir_name(name)
        if s is not None and s > step:
            _remove_step(Path(root) / name)
            removed.append(s)
    return removed


class BroadcastStore:
    """Read side of a broadcast root.

    A manifest is cached under the exact bytes of the COMPLETE marker that vouches for it (attempt,
    size and CRC-32 of the manifest); every :meth:`manifest` call re-reads the marker (a few dozen
    bytes), so a step the trainer republished is seen as new, and a pruned one as gone.
    """

    def __init__(self, root: str | os.PathLike, max_poll_s: float = 1.0):
        self.root = Path(root)
        self.max_poll_s = max_poll_s
        self._listing: set[int] | None = None
        self._manifests: dict[int, tuple[bytes, dict[str, Any]]] = {}

    def step_dir(self, step: int) -> Path:
        return self.root / fmt.step_dir_name(step)

    def checked_step_dir(self, step: int) -> Path:
        """The step's directory, refused (:class:`~rltune.sync.format.ManifestPathError`) if it is a link
        that resolves outside the broadcast root."""
        d = self.step_dir(step)
        try:
            resolved, root = d.resolve(), self.root.resolve()
        except (OSError, RuntimeError) as e:  # a link loop
            raise fmt.ManifestPathError(f"{d}: step {step}'s directory does not resolve ({e}); refused") from None
        if resolved == root or not resolved.is_relative_to(root):
            raise fmt.ManifestPathError(f"{d}: step {step}'s directory resolves to {resolved}, outside the broadcast "
                                        f"root {root}; refused (a link may only point inside the root)")
        return d

    def _relist(self) -> set[int]:
        # os.stat then os.listdir on the directory forces an NFS client to revalidate its entries.
        try:
            os.stat(self.root)
            names = os.listdir(self.root)
        except FileNotFoundError:
            names = []
        except OSError as e:
            raise fmt.ChainError(f"{self.root}: the broadcast root cannot be listed ({type(e).__name__}: {e})") from None
        self._listing = {s for s in (fmt.parse_step_dir_name(n) for n in names) if s is not None}
        return self._listing

    def steps(self, revalidate: bool = True) -> list[int]:
        """Step directories present (complete or not), ascending."""
        if revalidate or self._listing is None:
            self._relist()
        return sorted(self._listing)

    def is_complete(self, step: int) -> bool:
        """True when step's COMPLETE marker exists as a file; re-lists before answering no."""
        listing = self._listing if self._listing is not None else self._relist()
        if step not in listing:
            listing = self._relist()
            if step not in listing:
                return False
        d = self.step_dir(step)
        try:
            os.listdir(d)  # revalidate the step directory itself before probing its marker
        except OSError:  # gone, not a directory, unreadable
            return False
        return (d / fmt.COMPLETE_NAME).is_file()

    def complete_steps(self) -> list[int]:
        return [s for s in self.steps(revalidate=True) if self.is_complete(s)]

    def wait_complete(self, step: int, timeout_s: float) -> None:
        """Return once ``step`` is complete; poll with a capped, jittered exponential back-off (10 ms
        doubling to ``max_poll_s``), re-listing the directories each time; after ``timeout_s`` raise
        :class:`~rltune.sync.format.StepNotReadyError`."""
        deadline = time.monotonic() + timeout_s
        delay = 0.01
        while not self.is_complete(step):
            left = deadline - time.monotonic()
            if left <= 0:
                raise fmt.StepNotReadyError(f"{self.step_dir(step)}: step {step} is not complete after "
                                            f"{timeout_s:.1f} s; the trainer has not published it (yet)")
            time.sleep(min(left, delay * (0.5 + random.random())))
            delay = min(self.max_poll_s, delay * 2)

    def marker(self, step: int) -> tuple[bytes, dict[str, Any]]:
        """The step's COMPLETE marker (raw bytes, fields); :class:`StepNotReadyError` when there is none."""
        if not self.is_complete(step):
            self._manifests.pop(step, None)
            latest = max(self._listing or {-1})
            why = ("older than the latest step: pruned, load a newer anchor" if step < latest
                   else "wait for the trainer or load an older anchor")
            raise fmt.StepNotReadyError(f"{self.step_dir(step)}: step {step} is absent or not complete; {why}")
        return fmt.read_marker(self.checked_step_dir(step))

    def manifest(self, step: int) -> dict[str, Any]:
        raw, marker = self.marker(step)
        cached = self._manifests.get(step)
        if cached is not None and cached[0] == raw:
            return cached[1]
        manifest = fmt.read_manifest(self.checked_step_dir(step), marker)
        self._manifests[step] = (raw, manifest)
        return manifest

    def forget(self, step: int) -> None:
        """Drop a cached manifest (not needed for correctness: every read revalidates the marker)."""
        self._manifests.pop(step, None)

    def latest_loadable(self, at_most: int | None = None) -> int | None:
        """Latest complete step with anchor slices (kind anchor or full) at or below ``at_most``."""
        for s in reversed(self.complete_steps()):
            if at_most is not None and s > at_most:
                continue
            try:
                if self.manifest(s)["kind"] != "delta":
                    return s
            except fmt.SyncFormatError:
                continue  # a damaged or vanished step is no anchor to load
        return None

    def chain(self, target: int) -> tuple[int, list[int]]:
        """(anchor step to load, delta steps to apply after it) that reach ``target``: the newest of
        :meth:`chains`."""
        return self.chains(target, limit=1)[0]

    def chains(self, target: int, limit: int = 3) -> list[tuple[int, list[int]]]:
        """Every way to reach ``target`` (at most ``limit``), newest anchor first: ``(anchor, deltas)``.

        Follows ``base_step`` links back from the target, so no delta can be skipped; each link must
        name its base's attempt (``base_attempt``), so a chain never crosses a step the trainer
        republished after the delta was written. An anchor step on the way is a place to load (its
        delta parts carry it as a delta for the older chains behind it): when the newest anchor is
        damaged, an engine falls back to the one before it plus every delta since.
        """
        m = self.manifest(target)
        run_id, deltas, step = m["run_id"], [], target
        found: list[tuple[int, list[int]]] = []
        while True:
            if m["kind"] != "delta":
                found.append((step, deltas[::-1]))
                if m["kind"] == "full" or len(found) >= limit:
                    return found
            deltas.append(step)
            base, base_attempt = m["base_step"], m["base_attempt"]
            problem = None
            try:
                m = self.manifest(base)
            except fmt.SyncFormatError as exc:
                problem = (f"base of the chain to step {target} is gone (pruned or never written) or damaged "
                           f"({type(exc).__name__}); load a newer anchor")
            else:
                if m["run_id"] != run_id:
                    problem = (f"run_id {m['run_id']!r} differs from step {target}'s {run_id!r}; the chain crosses a "
                               "trainer restart")
                elif m["attempt"] != base_attempt:
                    problem = (f"step {base} was republished (attempt {m['attempt']}) after step {step} was diffed "
                               f"against its attempt {base_attempt}; load a newer anchor")
            if problem is not None:
                if found:
                    return found
                raise fmt.ChainError(f"{self.step_dir(base)}: {problem}")
            step = base
