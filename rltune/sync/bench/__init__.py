"""``rltune sync-bench``'s harness, apart from the sync library it measures.

- :mod:`.run`: the config (presets/sync/*.yaml), the run, its Parquet table and JSON record.
- :mod:`.pairs`: each transport of :mod:`rltune.sync.transports` paired with engines it can time
  and read back, for the bit-for-bit check.
- :mod:`.models`: the models it trains, built from their spec here; a command may hand the harness
  a builder of its own (``build_model=``). Like all of :mod:`rltune.sync`, nothing here imports a
  package above it (the reference workload, the tuner, the CLI).
"""

from rltune.sync.bench.models import BENCH_MODELS, ModelBuilder, build_bench_model
from rltune.sync.bench.run import (
    PRESET_DIR,
    RECORD_SCHEMA_VERSION,
    SUMMARY_COLUMNS,
    SYNC_BENCH_SCHEMA_VERSION,
    TRANSPORT_CHOICES,
    SyncBenchConfig,
    SyncBenchError,
    SyncBenchResult,
    build_record,
    device_info,
    git_sha,
    load_sync_bench_config,
    resolve_preset,
    run_sync_bench,
    summary_lines,
    with_overrides,
)

__all__ = ["BENCH_MODELS", "ModelBuilder", "PRESET_DIR", "RECORD_SCHEMA_VERSION", "SUMMARY_COLUMNS",
           "SYNC_BENCH_SCHEMA_VERSION", "TRANSPORT_CHOICES", "SyncBenchConfig", "SyncBenchError", "SyncBenchResult",
           "build_bench_model", "build_record", "device_info", "git_sha", "load_sync_bench_config", "resolve_preset",
           "run_sync_bench", "summary_lines", "with_overrides"]
