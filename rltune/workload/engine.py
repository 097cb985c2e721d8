"""The inference engine: a separate process that samples from the policy with a KV cache.

Each engine process holds a copy of the model and a batch of running sequences whose keys and
values live in one left-padded cache (rows = sequences, columns = positions). It returns every
sampled token with its log-probability under the temperature-scaled distribution.

Scheduling:
- ``static``: a new batch is admitted only when the running one has finished (a long sequence
  holds the whole batch).
- ``continuous``: after every decode step finished rows leave and waiting requests are prefilled
  and merged into the running batch (decode pauses while they prefill).
The KV budget (``kv_cache_tokens`` = rows x padded length) caps admission; when a growing batch
would exceed it, the newest sequence is preempted: its cache is dropped and it is re-queued to be
prefilled again (recompute), keeping what it had generated.

A request's tokens are drawn with its own uniforms (rltune.workload.sampling, from its
``sample_key`` and the job's seed): which engine serves it and what shares its batch do not change them.

Weights change only between decode steps; a sequence records the oldest weight version that
produced any of its tokens.

Messages in (one ``mp.Queue`` per engine): ``("generate", req_id, prompt_ids, max_new_tokens,
temperature, submit_monotonic, sample_key)``, ``("cancel", req_id)``, ``("load", version, message)``, ``("stats",)``, ``("stop",)``.
A load goes through the weight-sync transport's loader (:class:`WeightLoads`): its reads start
when the message arrives and the engine keeps decoding; it pauses for the in-place update once
they are done.
Messages out (shared queue): ``("ready", engine, info)``, ``("result", engine, req_id, record)``,
``("loaded", engine, version, info)``, ``("stats", engine, counters)``, ``("error", engine, text)``.
"""

from __future__ import annotations

import inspect
import os
import queue
import time
import traceback
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from rltune.workload.heap import frozen_heap
from rltune.workload.sampling import sample, seeded_key


@dataclass
class EngineSettings:
    """What an engine process needs to start (picklable)."""

    preset: str
    seed: int
    dtype: str
    device: str
    attn_implementation: str
    max_concurrent_seqs: int
    batching: str
    kv_cache_tokens: int
    compile: bool
    num_threads: int
    sample_seed: int
    loader: Any  # the weight-sync transport's engine side (a rltune.sync.transports Loader)
    max_context_tokens: int = 0  # the longest context a sequence reaches; sizes the CUDA-graph cache (0: kv_cache_tokens)


@dataclass
class _Sequence:
    req_id: int
    prompt: list[int]
    max_new_tokens: int
    temperature: float
    submitted: float
    key: int  # the request's draws (rltune.workload.sampling.seeded_key)
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    version: int | None = None
    admitted: float | None = None
    prefill_s: float = 0.0
    decode_start: float | None = None
    preemptions: int = 0
    finished_by_eos: bool = False

    @property
    def context(self) -> list[int]:
        return self.prompt + self.tokens


class Engine:
    """One engine's model, running batch and queue; ``serve`` is the process loop, ``step`` one iteration."""

    def __init__(self, index: int, settings: EngineSettings, out_queue):
        import torch

        from rltune.workload.model import build_model, torch_dtype
        from rltune.workload.tokenizer import TOKENIZER

        self.torch = torch
        self.index = index
        self.s = settings
        self.out = out_queue
        if settings.num_threads:
            torch.set_num_threads(settings.num_threads)
        self.device = torch.device(settings.device)
        self.model = build_model(settings.preset, settings.seed, torch_dtype(settings.dtype), self.device,
                                 settings.attn_implementation).eval()
        # engine.compile: on a GPU the decode step is replayed as CUDA graphs (rltune.workload.graph_decode)
        # and prefill runs eagerly; on a CPU, where there are no graphs, torch.compile compiles the forward.
        self.graph = None
        if settings.compile and self.device.type == "cuda":
            from rltune.workload.graph_decode import GraphDecoder, buffer_shape

            self.graph = GraphDecoder(self.model, *buffer_shape(settings.max_concurrent_seqs, settings.kv_cache_tokens,
                                                                settings.max_context_tokens))
        compiled = settings.compile and self.graph is None
        self.forward = torch.compile(self.model, dynamic=True) if compiled else self.model
        self._graph_keys: list | None = None  # the cache lists the last graph step handed back
        # transformers renamed the cache argument ('past_key_values' -> 'cache'); accept either.
        self.cache_kw = "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"
        self.eos = TOKENIZER.eos_id
        self.pad = TOKENIZER.pad_id
        self.loads = WeightLoads(settings.loader, self.model, index, out_queue)
        self.version = 0
        self.warm_up_s = 0.0
        self.parent_pid = os.getppid()  # the orchestrator; if it dies, this engine stops instead of serving on
        self.cancelled: set[int] = set()
        self.waiting: deque[_Sequence] = deque()
        self.running: list[_Sequence] = []
        self.keys: list = []  # per layer [B, H, T, D]
        self.values: list = []
        self.mask = None  # [B, T] long, 1 = real position
        self.positions = None  # [B] next position id of each row
        self.last_tokens = None  # [B] token to feed next
        self._reset_counters()

    def warm_up(self, prompt_len: int = 8, decode_steps: int = 3) -> None:
        """Compile the prefill and decode graphs before the engine reports ready.

        A compiled engine otherwise compiles inside its first requests, where the compile time
        counts against their time-out and the step's rollout time (serving engines compile and
        capture at start for the same reason). Batches of 2 and 1 are traced so that later batch
        sizes reuse the dynamic-shape graph instead of specialising on 1.
        """
        torch = self.torch
        from transformers.cache_utils import DynamicCache

        start = time.perf_counter()
        for batch in (2, 1):
            ids = torch.full((batch, prompt_len), self.eos, dtype=torch.long, device=self.device)
            mask = torch.ones_like(ids)
            positions = mask.cumsum(-1) - 1
            with torch.inference_mode():
                out = self.forward(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True)
                for step in range(decode_steps):
                    made = _output_cache(out)
                    cache = DynamicCache(ddp_cache_data=[(layer.keys, layer.values) for layer in made.layers],
                                         config=self.model.config)
                    mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
                    out = self.forward(input_ids=ids[:, -1:], attention_mask=mask,
                                       position_ids=positions[:, -1:] + step + 1, use_cache=True,
                                       **{self.cache_kw: cache})
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.warm_up_s = time.perf_counter() - start

    # -- counters -------------------------------------------------------------------------------
    def _reset_counters(self) -> None:
        self.counters = {"preemptions": 0, "kv_peak_frac": 0.0, "gen_tokens": 0, "prefill_s": 0.0,
                         "decode_s": 0.0, "forward_steps": 0, "busy_s": 0.0}

    def _note_kv(self) -> None:
        if self.mask is not None:
            used = self.mask.shape[0] * self.mask.shape[1] / self.s.kv_cache_tokens
            self.counters["kv_peak_frac"] = max(self.counters["kv_peak_frac"], used)

    # -- main loop -------------------------------------------------------------------------------
    def serve(self, in_queue) -> None:
        if self.graph is not None:
            start = time.perf_counter()
            with self.torch.inference_mode():
                self.graph.capture()
            self.warm_up_s = time.perf_counter() - start
        elif self.s.compile:
            self.warm_up()
        # before serving: the loader records what it needs of the engine (index map, latest step)
        attach = self.s.loader.attach(self.model) if self.s.loader is not None else {}
        self.out.put(("ready", self.index, {"params": sum(p.numel() for p in self.model.parameters()),
                                            "warm_up_s": self.warm_up_s, **attach}))
        while True:
            if os.getppid() != self.parent_pid:
                return  # the orchestrator was killed: an orphaned engine would generate on for nobody
            for msg in drain(in_queue, wait=not self.running and not self.waiting and self.loads.pending is None):
                if msg[0] == "stop":
                    # Release tensors shared by the trainer (CUDA IPC) before the process ends.
                    if self.s.loader is not None:
                        self.s.loader.close()
                    self.s.loader = None
                    return
                self.handle(msg)
            if self.loads.due(serving=bool(self.running or self.waiting)):
                self.loads.finish(self._loaded)
            self.step()

    def step(self) -> bool:
        """Admit (prefill) what fits, then decode one token for every running row; False if idle."""
        start = time.perf_counter()
        did = self._admit()
        if self.running:
            self._decode_step()
            did = True
        if did:
            self.counters["busy_s"] += time.perf_counter() - start
        return did

    def handle(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "generate":
            _, req_id, prompt, max_new, temperature, submitted, key = msg
            self.waiting.append(_Sequence(req_id, list(prompt), int(max_new), float(temperature), submitted,
                                          seeded_key(self.s.sample_seed, int(key))))
        elif kind == "cancel":
            # A trial that was cut off no longer wants this request: drop it wherever it is.
            self.cancelled.add(msg[1])
            self.waiting = deque(s for s in self.waiting if s.req_id != msg[1])
        elif kind == "load":
            _, version, message = msg
            self.loads.begin(version, message)
        elif kind == "stats":
            self.out.put(("stats", self.index, dict(self.counters, running=len(self.running), waiting=len(self.waiting))))
            self._reset_counters()
        else:
            raise ValueError(f"engine got an unknown message {kind!r}")

    def _loaded(self, version: int) -> None:
        if self.device.type == "cuda":
            self.torch.cuda.synchronize()
        self.version = version

    # -- scheduling -----------------------------------------------------------------------------
    def _admit(self) -> bool:
        if not self.waiting:
            return False
        if self.s.batching == "static" and self.running:
            return False
        width = self.mask.shape[1] if self.mask is not None else 0
        chosen: list[_Sequence] = []
        while self.waiting and len(self.running) + len(chosen) < self.s.max_concurrent_seqs:
            candidate = self.waiting[0]
            new_width = max(width, max(len(s.context) for s in [*chosen, candidate]))
            if (len(self.running) + len(chosen) + 1) * (new_width + 1) > self.s.kv_cache_tokens and (self.running or chosen):
                break
            chosen.append(self.waiting.popleft())
        if not chosen:
            return False
        self._prefill(chosen)
        return True

    @staticmethod
    def _logits(output):
        return output.logits

    def _prefill(self, seqs: list[_Sequence]) -> None:
        torch = self.torch
        start = time.perf_counter()
        now = time.monotonic()
        width = max(len(s.context) for s in seqs)
        ids = torch.full((len(seqs), width), self.pad, dtype=torch.long)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        for row, seq in enumerate(seqs):
            ctx = seq.context
            ids[row, width - len(ctx):] = torch.tensor(ctx)
            mask[row, width - len(ctx):] = 1
            if seq.admitted is None:
                seq.admitted = now
            if seq.version is None:
                seq.version = self.version
        ids, mask = ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        with torch.inference_mode():
            out = self.forward(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True)
        cache = _output_cache(out)
        new_keys = [layer.keys for layer in cache.layers]
        new_values = [layer.values for layer in cache.layers]
        self._merge(seqs, new_keys, new_values, mask, mask.sum(-1))
        elapsed = time.perf_counter() - start
        self.counters["prefill_s"] += elapsed
        for seq in seqs:
            seq.prefill_s += elapsed
            seq.decode_start = time.monotonic()
        # The prefill's last logits give each new row its first sampled token.
        self._sample_and_advance(out.logits[:, -1, :], rows=list(range(len(self.running) - len(seqs), len(self.running))))

    def _merge(self, seqs, new_keys, new_values, new_mask, new_positions) -> None:
        torch = self.torch
        if not self.running:
            self.keys, self.values, self.mask = new_keys, new_values, new_mask
            self.positions = new_positions
            self.last_tokens = torch.zeros(len(seqs), dtype=torch.long, device=self.device)
            self.running = list(seqs)
            self._note_kv()
            return
        width = max(self.mask.shape[1], new_mask.shape[1])

        def left_pad(t, dim_len, value=0):
            missing = width - dim_len
            if missing == 0:
                return t
            shape = list(t.shape)
            shape[2 if t.dim() == 4 else 1] = missing
            return torch.cat([torch.full(shape, value, dtype=t.dtype, device=t.device), t], dim=2 if t.dim() == 4 else 1)

        old_w, new_w = self.mask.shape[1], new_mask.shape[1]
        self.keys = [torch.cat([left_pad(a, old_w), left_pad(b, new_w)]) for a, b in zip(self.keys, new_keys, strict=True)]
        self.values = [torch.cat([left_pad(a, old_w), left_pad(b, new_w)]) for a, b in zip(self.values, new_values, strict=True)]
        self.mask = torch.cat([left_pad(self.mask, old_w), left_pad(new_mask, new_w)])
        self.positions = torch.cat([self.positions, new_positions])
        self.last_tokens = torch.cat([self.last_tokens, torch.zeros(len(seqs), dtype=torch.long, device=self.device)])
        self.running.extend(seqs)
        self._note_kv()

    def _sample_and_advance(self, logits_BV, rows: list[int]) -> None:
        """Sample a token for each listed row (``logits_BV[i]`` belongs to ``rows[i]``); finish rows that are done."""
        torch = self.torch
        temps = torch.tensor([self.running[r].temperature for r in rows], device=self.device).unsqueeze(-1)
        logp = torch.log_softmax(logits_BV.float() / temps, dim=-1)
        seqs = [self.running[r] for r in rows]
        keys = torch.tensor([s.key for s in seqs], dtype=torch.int64, device=self.device)
        positions = torch.tensor([len(s.tokens) for s in seqs], dtype=torch.int64, device=self.device)
        picked = sample(logp, keys, positions)
        picked_logp = logp.gather(-1, picked.unsqueeze(-1)).squeeze(-1)
        row_index = torch.tensor(rows, device=self.device)
        self.last_tokens[row_index] = picked
        self.counters["gen_tokens"] += len(rows)
        done = []
        for r, token, lp in zip(rows, picked.tolist(), picked_logp.tolist(), strict=True):
            seq = self.running[r]
            if seq.req_id in self.cancelled:
                done.append(r)
                continue
            seq.tokens.append(token)
            seq.logprobs.append(lp)
            seq.version = min(seq.version, self.version)
            if token == self.eos:
                seq.finished_by_eos = True
                done.append(r)
            elif len(seq.tokens) >= seq.max_new_tokens:
                done.append(r)
        if done:
            self._finish(done)

    def _keep_rows(self, keep: list[int]) -> None:
        torch = self.torch
        if not keep:
            self.running, self.keys, self.values, self.mask = [], [], [], None
            self.positions = self.last_tokens = None
            return
        idx = torch.tensor(keep, device=self.device)
        self.running = [self.running[i] for i in keep]
        self.mask = self.mask.index_select(0, idx)
        # Columns that are padding in every remaining row are dead weight: trim them.
        live = self.mask.any(0).nonzero()
        first = int(live[0]) if len(live) else 0
        self.mask = self.mask[:, first:]
        self.keys = [k.index_select(0, idx)[:, :, first:] for k in self.keys]
        self.values = [v.index_select(0, idx)[:, :, first:] for v in self.values]
        self.positions = self.positions.index_select(0, idx)
        self.last_tokens = self.last_tokens.index_select(0, idx)

    def _finish(self, rows: list[int]) -> None:
        now = time.monotonic()
        for r in rows:
            seq = self.running[r]
            if seq.req_id in self.cancelled:
                self.cancelled.discard(seq.req_id)
                continue
            self.out.put(("result", self.index, seq.req_id, {
                "tokens": seq.tokens, "logprobs": seq.logprobs, "version": seq.version,
                "queue_s": seq.admitted - seq.submitted, "prefill_s": seq.prefill_s,
                "decode_s": now - seq.decode_start, "preemptions": seq.preemptions,
                "eos": seq.finished_by_eos,
            }))
        gone = set(rows)
        self._keep_rows([i for i in range(len(self.running)) if i not in gone])

    def _preempt_if_needed(self) -> None:
        # Growing by one column must fit the budget; otherwise drop the newest rows (recompute later).
        while len(self.running) > 1 and len(self.running) * (self.mask.shape[1] + 1) > self.s.kv_cache_tokens:
            victim = self.running[-1]
            victim.preemptions += 1
            self.counters["preemptions"] += 1
            self.waiting.appendleft(victim)
            self._keep_rows(list(range(len(self.running) - 1)))

    def _decode_step(self) -> None:
        torch = self.torch
        from transformers.cache_utils import DynamicCache

        self._preempt_if_needed()
        start = time.perf_counter()
        if self.graph is not None and self.graph.fits(len(self.running), self.mask.shape[1]):
            self._graph_decode_step(start)
            return
        cache = DynamicCache(ddp_cache_data=list(zip(self.keys, self.values, strict=True)), config=self.model.config)
        ones = torch.ones((self.mask.shape[0], 1), dtype=self.mask.dtype, device=self.device)
        mask = torch.cat([self.mask, ones], dim=1)
        with torch.inference_mode():
            out = self.forward(input_ids=self.last_tokens.unsqueeze(-1), attention_mask=mask,
                               position_ids=self.positions.unsqueeze(-1), use_cache=True, **{self.cache_kw: cache})
        new_cache = _output_cache(out)
        self.keys = [layer.keys for layer in new_cache.layers]
        self.values = [layer.values for layer in new_cache.layers]
        self.mask = mask
        self.positions = self.positions + 1
        self._note_kv()
        self.counters["decode_s"] += time.perf_counter() - start
        self.counters["forward_steps"] += 1
        self._sample_and_advance(out.logits[:, -1, :], rows=list(range(len(self.running))))

    def _graph_decode_step(self, start: float) -> None:
        """The decode step on the graph decoder's buffers; the engine's cache becomes views of them."""
        batch = len(self.running)
        if self.keys is not self._graph_keys:  # rows joined, finished or were preempted since the last step
            self.graph.load(self.keys, self.values, self.mask)
        with self.torch.inference_mode():
            logits = self.graph.step(self.last_tokens, self.positions)
        self.keys, self.values, self.mask = self.graph.cache(batch)
        self._graph_keys = self.keys
        self.positions = self.positions + 1
        self._note_kv()
        self.counters["decode_s"] += time.perf_counter() - start
        self.counters["forward_steps"] += 1
        self._sample_and_advance(logits, rows=list(range(batch)))


def drain(in_queue, wait: bool, timeout: float = 0.5) -> list:
    """Every message waiting in an engine's queue; an idle engine (``wait``) first waits up to ``timeout`` for one."""
    messages = []
    try:
        messages.append(in_queue.get(timeout=timeout) if wait else in_queue.get_nowait())
        while True:
            messages.append(in_queue.get_nowait())
    except queue.Empty:
        pass
    return messages


class WeightLoads:
    """An engine's weight updates through its transport's loader, the same for both engine backends.

    A ``("load", version, message)`` message starts the loader's prefetch at once (reading and
    decoding run while the engine keeps serving); the engine pauses for :meth:`finish` only once
    the loader is ready, or at once when it has nothing to serve. The ``loaded`` reply says how
    long the update took from the message (``load_s``), how long dispatch was stopped for it
    (``blocking_s``, the loader's ``load``) and what the loader did.
    """

    def __init__(self, loader, target, index: int, out):
        self.loader, self.target, self.index, self.out = loader, target, index, out
        self.pending: tuple[int, dict, float] | None = None

    def begin(self, version: int, message: dict) -> None:
        if self.pending is not None:  # the orchestrator waits for each load: a second one is a protocol error
            raise RuntimeError(f"engine {self.index}: a load of version {version} arrived while "
                               f"version {self.pending[0]} was still loading")
        start = time.perf_counter()
        self.loader.prefetch(self.target, message)
        self.pending = (int(version), message, start)

    def due(self, serving: bool) -> bool:
        """A load is pending and may run now (its prefetch is done, or nothing else would run meanwhile)."""
        return self.pending is not None and (not serving or self.loader.ready())

    def finish(self, after) -> int:
        """Load in the pause, run ``after(version)`` (the engine's own bookkeeping), reply ``loaded``."""
        version, message, start = self.pending
        self.pending = None
        paused = time.perf_counter()
        result = self.loader.load(self.target, message)
        after(version)
        done = time.perf_counter()
        info = {"load_s": done - start, "blocking_s": done - paused, "bytes": float(result.bytes),
                "prefetched": float(result.prefetched), **result.details}
        if result.changes is not None:
            info.update(changes_applied=float(result.changes), reloaded=float(result.action == "reload"))
        self.out.put(("loaded", self.index, version, info))
        return version


def _output_cache(out):
    cache = out.get("cache") if hasattr(out, "get") else None
    return cache if cache is not None else out.past_key_values


def _drop_stdlib_shadows() -> None:
    """Remove sys.path entries (inherited from the parent by spawn) that shadow a standard-library
    module: e.g. a test tree with a ``profile`` package breaks ``cProfile``, which torch imports."""
    import sys

    stdlib = sys.stdlib_module_names
    installed = tuple(os.path.realpath(p) for p in {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix})
    kept = []
    for entry in sys.path:
        if os.path.realpath(entry or ".").startswith(installed) or entry.endswith(".zip"):
            kept.append(entry)  # the interpreter's own library and installed packages stay
            continue
        try:
            names = os.listdir(entry or ".")
        except OSError:
            kept.append(entry)
            continue
        shadows = any(name in stdlib and os.path.exists(os.path.join(entry or ".", name, "__init__.py"))
                      for name in names)
        if not shadows:
            kept.append(entry)
    sys.path[:] = kept


def engine_main(index: int, settings: EngineSettings, in_queue, out_queue) -> None:
    """Entry point of an engine process (a vLLM engine's, :mod:`rltune.workload.engine_vllm`, for its settings)."""
    if getattr(settings, "backend", "hf") == "vllm":
        _drop_stdlib_shadows()
        from rltune.workload.engine_vllm import engine_main as vllm_engine_main

        vllm_engine_main(index, settings, in_queue, out_queue)
        return
    try:
        _drop_stdlib_shadows()
        engine = Engine(index, settings, out_queue)
        with frozen_heap():  # the model and torch stay out of the collector's walks while it serves
            engine.serve(in_queue)
    except Exception:  # report any crash to the orchestrator, which turns it into an RltuneError
        out_queue.put(("error", index, traceback.format_exc()))
