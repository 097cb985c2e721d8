"""Sparse delta weight sync: publish only the elements an optimizer step changed, between anchors.

See docs/delta-format.md for the byte format. ``kernels.reference`` holds the torch reference of
every element operation; the Triton kernels beside it are compared with it bit for bit.

Public API (each module's docstring has a usage example):

- ``rltune.sync.sender.DeltaPublisher(model, optimizer, root, interval, ..., config=DeltaPublisherConfig(...))``
  with ``.step()`` (replaces ``optimizer.step()``) and ``.publish(step)``; ``SignSGD``.
- ``rltune.sync.chunked.chunked_step(optimizer, hook, max_elements)`` and ``DeltaRecorder``: the
  optimizer step in updates of at most ``max_elements`` (small parameters together, large ones in
  chunks) with a hook around each, and the recorder of the step's changes.
- ``rltune.sync.receiver.DeltaReceiver(root, model, index_map, group=None, apply_fn=...)`` with
  ``.prefetch(step)``, ``.apply(step)``, ``.load_latest()``.
- ``rltune.sync.indexmap.IndexMap.record(build_engine, spec)``: the checkpoint -> parameter map,
  recorded from the engine's own ``load_weights``.
- ``rltune.sync.codec.encode(idx, diff, bits, start, stop)`` / ``decode(data, start, stop)`` and
  ``order0_bound_bytes(numel, diff)``; ``encode_many(jobs)`` on the host's cores.
- ``rltune.sync.codec_gpu.encode_many_gpu(jobs)``: the same bytes from changes held on a GPU (what
  the publisher uses when the weights live on one).
- ``rltune.sync.format``: constants and one exception class per rule of the spec.
- ``rltune.sync.store.BroadcastStore(root)``: complete steps, manifests, chains.
- ``rltune.sync.ops``: relative-delta reference ops (``wire_diff``, ``wire_add``,
  ``apply_mapped_delta_ref``) that a GPU kernel must match.
- ``rltune.sync.toy_engine.ToyEngine``: a small vLLM-style engine (fused qkv/gate_up, TP slicing).
- ``rltune.sync.transports``: the one weight-sync transport layer (a trainer-side ``Publisher``, an
  engine-side ``Loader``; filesystem, inprocess, sparse_delta, nccl; ``make_publisher``), used by
  the reference workload and sync-bench.
- ``rltune.sync.vllm``: the worker extension and ``VllmReceiver`` for real vLLM engines.
- ``rltune.sync.bench``: the sync-bench harness.
"""
