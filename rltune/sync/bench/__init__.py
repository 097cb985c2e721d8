"""``rltune sync-bench``'s harness, apart from the sync library it measures.

- :mod:`.run`: the config (presets/sync/*.yaml), the run, its Parquet table and JSON record.
- :mod:`.pairs`: each transport of :mod:`rltune.sync.transports` paired with engines it can time
  and read back, for the bit-for-bit check.
"""

from rltune.sync.bench.run import (
    PRESET_DIR,
    RECORD_SCHEMA_VERSION,
    SUMMARY_COLUMNS,
    SYNC_BENCH_SCHEMA_VERSION,
    TRANSPORT_CHOICES,
    SyncBenchConfig,
    SyncBenchError,
    SyncBenchResult,
    _bit_equal,  # noqa: F401 (the bit-for-bit check, used by the transport tests)
    build_record,
    device_info,
    git_sha,
    load_sync_bench_config,
    resolve_preset,
    run_sync_bench,
    summary_lines,
    with_overrides,
)

__all__ = ["PRESET_DIR", "RECORD_SCHEMA_VERSION", "SUMMARY_COLUMNS", "SYNC_BENCH_SCHEMA_VERSION", "TRANSPORT_CHOICES",
           "SyncBenchConfig", "SyncBenchError", "SyncBenchResult", "build_record", "device_info", "git_sha",
           "load_sync_bench_config", "resolve_preset", "run_sync_bench", "summary_lines", "with_overrides"]
