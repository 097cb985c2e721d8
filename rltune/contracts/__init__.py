"""The files that pass between rltune's stages: one schema each, versioned, validated on load.

Each artifact has its own module: ``job`` (job.yaml), ``stages`` (stages.parquet), ``diagnosis``,
``knowledge``, ``candidates``, ``forecast``, ``cases`` (the case library) and ``verdict``. All YAML
schemas use :mod:`rltune.contracts.schema`; docs/artifacts.md documents every field.
"""
