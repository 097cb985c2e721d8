"""The engine's decode step on fixed buffers, replayed as CUDA graphs (``engine.compile`` on a GPU).

An eager decode step of the HF model launches ~40 kernels a layer from Python and grows its
cache by concatenation; on one H200 the small job's step (26 layers, 64-128 rows) spent ~60 ms
launching kernels that compute for a few. Serving engines capture the decode step once per batch
size and replay it (vLLM's CUDA graphs); this module does the same for the workload's engine.

The cache lives in one buffer per layer, ``[rows, kv_heads, columns, head_dim]``. The engine's
batch is left-padded so that every running row writes its next key and value at the same column
``width``; a step writes that column for all rows (``index_copy_`` at a column held in a device
tensor, so the captured graph reads it afresh at every replay), marks it in the mask and attends
over every column with the mask (unwritten columns are masked out, so their contents never
count). Rows beyond the live batch of a bucket are dead: they compute on stale inputs that nothing
reads.

The decoder keeps no state of its own beyond the buffers: the engine hands it a cache whenever its
batch changed shape (rows joined, finished or were preempted: :meth:`GraphDecoder.load`) and takes
views of the buffers back after each step, so admission, preemption and row removal stay the
engine's (:mod:`rltune.workload.engine`).

The step is the HF model's own modules in the same order (norms, projections, rotary embedding,
scaled-dot-product attention, MLP). A graph replayed for a full bucket equals the same step run
eagerly bit for bit; a partial bucket computes its dead rows too, so its matrix products may
round differently from an eager batch of the live rows alone; an eager step equals HF's forward to
float rounding (tests/workload/test_graph_decode.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def buffer_shape(max_seqs: int, kv_cache_tokens: int, max_context_tokens: int) -> tuple[int, int]:
    """(rows, columns) of the buffers: columns for the longest context (0: the KV budget), and no more
    rows than the engine's KV budget holds at that width, so the buffers never take more memory than
    ``engine.kv_cache_tokens`` allows; a larger batch runs eagerly."""
    columns = min(kv_cache_tokens, (max_context_tokens or kv_cache_tokens) + 1)
    return max(1, min(max_seqs, kv_cache_tokens // columns)), columns


def buckets(rows: int) -> list[int]:
    """Batch sizes a graph is captured for: powers of two below ``rows``, and ``rows``."""
    sizes, b = [], 1
    while b < rows:
        sizes.append(b)
        b *= 2
    return [*sizes, rows]


class GraphDecoder:
    """One decode step of a Qwen3 model on fixed buffers; ``capture()`` records it as CUDA graphs.

    ``rows``: the most sequences decoded at once; ``columns``: the longest padded context (prompt
    plus generated tokens) a row may reach. A step that would need more (:meth:`fits` is False)
    is the engine's to run eagerly.
    """

    def __init__(self, model, rows: int, columns: int):
        import torch

        self.torch = torch
        self.model = model
        cfg = model.config
        first = next(model.parameters())
        self.device, dtype = first.device, first.dtype
        self.rows, self.columns = rows, columns
        self.layers = list(model.model.layers[: cfg.num_hidden_layers])
        kv_heads, head_dim = cfg.num_key_value_heads, cfg.head_dim
        shape = (rows, kv_heads, columns, head_dim)
        # zeros, not empty: masked columns are multiplied by exactly 0, which keeps them out only if finite
        self.keys = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in self.layers]
        self.values = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in self.layers]
        self.mask = torch.zeros((rows, columns), dtype=torch.bool, device=self.device)
        self.tokens = torch.zeros(rows, dtype=torch.long, device=self.device)
        self.positions = torch.zeros(rows, dtype=torch.long, device=self.device)
        self.column = torch.zeros(1, dtype=torch.long, device=self.device)  # the column this step writes
        self.width = 0  # columns in use; the next step writes column ``width``
        self.graphs: dict[int, tuple] = {}  # bucket -> (CUDAGraph, its output logits)

    # -- the engine's side -------------------------------------------------------------------------
    def fits(self, batch: int, width: int) -> bool:
        """Whether a step of ``batch`` rows whose cache is ``width`` columns wide runs here."""
        return 0 < batch <= self.rows and width < self.columns

    def load(self, keys: list, values: list, mask) -> None:
        """Take the engine's cache (per layer ``[B, H, W, D]``, mask ``[B, W]``) into the buffers.

        The sources are never views of these buffers: the engine replaces its cache by new tensors
        (concatenation, row selection) whenever the batch changes shape, which is when it calls this.
        """
        batch, width = mask.shape
        self.mask.zero_()
        self.mask[:batch, :width].copy_(mask.bool())
        for buf, src in zip(self.keys, keys, strict=True):
            buf[:batch, :, :width].copy_(src)
        for buf, src in zip(self.values, values, strict=True):
            buf[:batch, :, :width].copy_(src)
        self.width = width

    def step(self, tokens, positions):
        """Decode one token for each of the first ``len(tokens)`` rows; their logits ``[B, V]``."""
        batch = tokens.shape[0]
        self.tokens[:batch].copy_(tokens)
        self.positions[:batch].copy_(positions)
        self.column.fill_(self.width)
        bucket = next((b for b in self.graphs if b >= batch), None)  # captured smallest first
        if bucket is None:
            logits = self._forward(batch)
        else:
            graph, logits = self.graphs[bucket]
            graph.replay()
        self.width += 1
        return logits[:batch]

    def cache(self, batch: int) -> tuple[list, list, torch.Tensor]:
        """The first ``batch`` rows' cache as the engine holds it: views of the buffers, mask as long."""
        w = self.width
        return ([k[:batch, :, :w] for k in self.keys], [v[:batch, :, :w] for v in self.values],
                self.mask[:batch, :w].long())

    # -- the step ----------------------------------------------------------------------------------
    def _forward(self, batch: int):
        """One decode step over the first ``batch`` rows of the buffers (what a graph captures)."""
        from torch.nn.functional import scaled_dot_product_attention
        from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

        body = self.model.model
        mask = self.mask[:batch]
        mask.index_fill_(1, self.column, True)
        attend = mask[:, None, None, :]
        hidden = body.embed_tokens(self.tokens[:batch]).unsqueeze(1)  # [B, 1, hidden]
        cos, sin = body.rotary_emb(hidden, self.positions[:batch].unsqueeze(1))
        for layer, key_buf, value_buf in zip(self.layers, self.keys, self.values, strict=True):
            attn = layer.self_attn
            x = layer.input_layernorm(hidden)
            heads = (batch, 1, -1, attn.head_dim)
            q = attn.q_norm(attn.q_proj(x).view(heads)).transpose(1, 2)
            k = attn.k_norm(attn.k_proj(x).view(heads)).transpose(1, 2)
            v = attn.v_proj(x).view(heads).transpose(1, 2)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            keys, values = key_buf[:batch], value_buf[:batch]
            keys.index_copy_(2, self.column, k)
            values.index_copy_(2, self.column, v)
            out = scaled_dot_product_attention(q, keys, values, attn_mask=attend, scale=attn.scaling,
                                               enable_gqa=keys.shape[1] != q.shape[1])
            hidden = hidden + attn.o_proj(out.transpose(1, 2).reshape(batch, 1, -1))
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        return self.model.lm_head(body.norm(hidden))[:, 0]

    def capture(self) -> None:
        """Record the step for every bucket (CUDA only); later steps replay the smallest that fits.

        Capturing runs the step (warm-ups, then the recorded run) on the buffers as they are, which
        is harmless before the first :meth:`load`: every column it writes is masked out or rewritten.
        """
        torch = self.torch
        if self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, not {self.device}")
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(self.device)
        with torch.inference_mode():
            for bucket in sorted(buckets(self.rows), reverse=True):  # largest first: the pool fits the rest
                side.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(side):
                    for _ in range(2):
                        self._forward(bucket)
                torch.cuda.current_stream(self.device).wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    logits = self._forward(bucket)
                self.graphs[bucket] = (graph, logits)
        self.graphs = dict(sorted(self.graphs.items()))
        self.mask.zero_()
        torch.cuda.synchronize(self.device)
