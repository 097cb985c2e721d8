"""The GRPO trainer, and its torchrun entrypoint.

``python -m rltune.workload.trainer CONFIG.yaml --run-dir DIR [--steps N] [key=value ...]`` under
torchrun starts one trainer process per rank (DDP over gloo on a CPU, nccl on a GPU). Rank 0 also
runs the orchestrator (engines, environments, weight sync) and hands every rank its shard of each
batch; the other ranks follow its commands. World size 1 runs the same code without a process group.

Shape suffixes: ``_B`` one per sample row, ``_T`` one per token position, ``_BT`` both.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rltune.workload.config import WorkloadConfig
from rltune.workload.grpo import clipped_policy_loss
from rltune.workload.heap import frozen_heap
from rltune.workload.model import build_model, resolve_device, torch_dtype
from rltune.workload.tokenizer import TOKENIZER

if TYPE_CHECKING:
    import torch


@dataclass
class TrainSample:
    """One trial as the trainer sees it: tokens, which of them the model generated, and their logprobs."""

    tokens: list[int]
    loss_mask: list[bool]  # True where tokens[i] was sampled by the engine
    rollout_logprobs: list[float]  # engine logprob at each sampled position (0 elsewhere)
    advantage: float
    version: int


class GRPOTrainer:
    """Policy, optimizer and the GRPO update on this rank's shard of each batch."""

    def __init__(self, cfg: WorkloadConfig, rank: int = 0, world_size: int = 1):
        import torch

        self.cfg = cfg
        self.t = cfg.trainer
        self.rank, self.world_size = rank, world_size
        if self.t.num_threads:
            torch.set_num_threads(self.t.num_threads)
        device = resolve_device(self.t.device)
        if cfg.placement.split:
            from rltune.workload.placement import place, visible_gpus

            device = place(cfg, visible_gpus(), device, device).trainer[rank]
        elif device == "cuda" and world_size > 1:
            device = f"cuda:{int(os.environ.get('LOCAL_RANK', rank))}"
        self.device = torch.device(device)
        self.model = build_model(cfg.model.preset, cfg.model.seed, torch_dtype(cfg.model.dtype), self.device,
                                 cfg.model.attn_implementation)
        if self.t.grad_checkpointing:
            if hasattr(self.model, "activation_checkpointing_enable"):  # transformers >= 5.x name
                self.model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.model.config.use_cache = False
        self.module = self.model
        if world_size > 1:
            from torch.nn.parallel import DistributedDataParallel

            ids = [self.device.index] if self.device.type == "cuda" else None
            self.model = DistributedDataParallel(self.module, device_ids=ids)
        self.optimizer = torch.optim.AdamW(self.module.parameters(), lr=self.t.lr, weight_decay=self.t.weight_decay)
        self.version = 0
        self.temperature = cfg.env.temperature
        # A weight-sync transport that diffs inside the optimizer step (drives_optimizer_step) replaces this.
        self.optimizer_step = self.optimizer.step

    # -- batching ---------------------------------------------------------------------------------
    def shard(self, samples: list[TrainSample]) -> list[TrainSample]:
        """This rank's samples. Every rank gets the same count (DDP needs the same number of backward
        calls on each rank), so the list is first padded with copies that carry no loss."""
        if self.world_size > 1 and len(samples) % self.world_size:
            filler = TrainSample(samples[0].tokens, [False] * len(samples[0].tokens),
                                 samples[0].rollout_logprobs, 0.0, samples[0].version)
            samples = samples + [filler] * (self.world_size - len(samples) % self.world_size)
        return samples[self.rank::self.world_size]

    def _micro_batches(self, samples: list[TrainSample]) -> list[list[int]]:
        size = self.t.micro_batch_size
        return [list(range(i, min(i + size, len(samples)))) for i in range(0, len(samples), size)]

    def _collate(self, samples: list[TrainSample], old_logprobs: list[torch.Tensor] | None):
        """Model inputs for some samples, padded (one row each) or packed (one row in all).

        Returns (inputs dict, targets_BT, mask_BT, rollout_lp_BT, old_lp_BT or None, adv_BT,
        real_tokens, total_tokens). Targets are the next token; mask marks sampled targets.
        """
        torch = self.torch
        rows = [[s] for s in samples] if not self.t.packing else [samples]
        lengths = [sum(len(s.tokens) for s in row) for row in rows]
        width = max(lengths)
        n = len(rows)
        ids = torch.full((n, width), TOKENIZER.pad_id, dtype=torch.long)
        attn = torch.zeros((n, width), dtype=torch.long)
        pos = torch.zeros((n, width), dtype=torch.long)
        mask = torch.zeros((n, width), dtype=torch.bool)
        roll = torch.zeros((n, width), dtype=torch.float32)
        old = torch.zeros((n, width), dtype=torch.float32) if old_logprobs is not None else None
        adv = torch.zeros((n, width), dtype=torch.float32)
        index = 0
        for r, row in enumerate(rows):
            offset = 0
            for s in row:
                length = len(s.tokens)
                sl = slice(offset, offset + length)
                ids[r, sl] = torch.tensor(s.tokens)
                attn[r, sl] = 1
                pos[r, sl] = torch.arange(length)
                # Target at position i is token i+1: shift mask and logprobs left by one.
                mask[r, offset:offset + length - 1] = torch.tensor(s.loss_mask[1:], dtype=torch.bool)
                roll[r, offset:offset + length - 1] = torch.tensor(s.rollout_logprobs[1:])
                if old is not None:
                    old[r, offset:offset + length - 1] = old_logprobs[index][1:]
                adv[r, sl] = s.advantage * self.t.advantage_sign
                offset += length
                index += 1
        targets = torch.roll(ids, -1, dims=1)
        dev = self.device
        if self.t.packing:
            # attention_mask=None + restarting position_ids: transformers builds a block-diagonal mask.
            inputs = {"input_ids": ids.to(dev), "position_ids": pos.to(dev)}
        else:
            inputs = {"input_ids": ids.to(dev), "attention_mask": attn.to(dev), "position_ids": pos.to(dev)}
        return (inputs, targets.to(dev), mask.to(dev), roll.to(dev), None if old is None else old.to(dev),
                adv.to(dev), sum(lengths), n * width)

    @property
    def torch(self):
        import torch

        return torch

    def _token_logprobs(self, inputs: dict, targets_BT: torch.Tensor) -> torch.Tensor:
        from rltune.workload.model import sampled_logprobs

        logits = self.model(**inputs, use_cache=False).logits
        return sampled_logprobs(logits, targets_BT, self.temperature)

    def _sync_device(self) -> None:
        if self.device.type == "cuda":
            self.torch.cuda.synchronize(self.device)

    # -- passes -----------------------------------------------------------------------------------
    def old_logprobs(self, samples: list[TrainSample]) -> list[torch.Tensor]:
        """The separate no-grad pass: per sample, the current policy's logprob of every next token."""
        torch = self.torch
        out: list[torch.Tensor] = []
        self.model.eval()
        with torch.no_grad():
            for mb in self._micro_batches(samples):
                chosen = [samples[i] for i in mb]
                inputs, targets, *_ = self._collate(chosen, None)
                lp = self._token_logprobs(inputs, targets).float().cpu()
                if self.t.packing:
                    offset = 0
                    for s in chosen:
                        out.append(lp[0, offset:offset + len(s.tokens)].roll(1))
                        offset += len(s.tokens)
                else:
                    for r, s in enumerate(chosen):
                        out.append(lp[r, :len(s.tokens)].roll(1))
        self._sync_device()
        return out

    def train(self, samples: list[TrainSample], old_logprobs: list[torch.Tensor] | None) -> dict[str, float]:
        """One GRPO update (``mini_batches`` optimizer steps) on this rank's samples; returns measurements."""
        torch = self.torch
        start = time.perf_counter()
        self.model.train()
        compute_s = 0.0
        gap_sum = gap_n = 0.0
        real = total = 0
        loss_sum = clip_sum = 0.0
        micro_count = 0
        n_mini = min(self.t.mini_batches, max(1, len(samples)))
        per_mini = math.ceil(len(samples) / n_mini)
        for m in range(n_mini):
            mini = samples[m * per_mini:(m + 1) * per_mini]
            mini_old = old_logprobs[m * per_mini:(m + 1) * per_mini] if old_logprobs is not None else None
            tokens_in_mini = max(1, sum(sum(s.loss_mask[1:]) for s in mini))
            micro = self._micro_batches(mini)
            self.optimizer.zero_grad(set_to_none=True)
            for k, mb in enumerate(micro):
                chosen = [mini[i] for i in mb]
                chosen_old = [mini_old[i] for i in mb] if mini_old is not None else None
                inputs, targets, mask, roll, old, adv, n_real, n_total = self._collate(chosen, chosen_old)
                real += n_real
                total += n_total
                t0 = time.perf_counter()
                last = k == len(micro) - 1
                context = self.model.no_sync() if self.world_size > 1 and not last else contextlib.nullcontext()
                with context:
                    logp = self._token_logprobs(inputs, targets)
                    reference = old if old is not None else roll
                    loss, stats = clipped_policy_loss(logp, reference, adv, mask,
                                                      self.t.clip_eps, tokens_in_mini)
                    loss.backward()
                self._sync_device()
                compute_s += time.perf_counter() - t0
                if m == 0:  # before any optimizer step of this batch: the trainer's view of the rollout policy
                    diff = (logp.detach().float() - roll).abs() * mask
                    gap_sum += float(diff.sum())
                    gap_n += float(mask.sum())
                loss_sum += float(loss.detach())
                clip_sum += stats["clip_frac"]
                micro_count += 1
            t0 = time.perf_counter()
            if self.t.max_grad_norm > 0:
                torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.t.max_grad_norm)
            self.optimizer_step()
            self._sync_device()
            compute_s += time.perf_counter() - t0
        self.version += 1
        elapsed = time.perf_counter() - start
        return {"gap_sum": gap_sum, "gap_n": gap_n, "real_tokens": float(real), "total_tokens": float(total),
                "compute_s": compute_s, "train_elapsed_s": elapsed, "loss": loss_sum / max(1, n_mini),
                "clip_frac": clip_sum / max(1, micro_count), "micro_batches": float(micro_count)}


# -- distributed plumbing --------------------------------------------------------------------------

class DistributedTrainer:
    """Rank 0's handle: broadcasts each command so every rank runs it on its shard, and reduces results."""

    def __init__(self, trainer: GRPOTrainer):
        self.trainer = trainer

    @property
    def version(self) -> int:
        return self.trainer.version

    @property
    def module(self):
        return self.trainer.module

    @property
    def optimizer(self):
        return self.trainer.optimizer

    def _broadcast(self, command: Any) -> None:
        if self.trainer.world_size > 1:
            import torch.distributed as dist

            payload = [command]
            dist.broadcast_object_list(payload, src=0)

    def step(self, samples: list[TrainSample], separate_old_pass: bool) -> dict[str, float]:
        self._broadcast(("step", samples, separate_old_pass))
        return run_step(self.trainer, samples, separate_old_pass)

    def stop(self) -> None:
        self._broadcast(("stop",))


def run_step(trainer: GRPOTrainer, samples: list[TrainSample], separate_old_pass: bool) -> dict[str, float]:
    """Old-logprob pass (if asked) + update on this rank's shard; gap and token counts summed over ranks."""
    mine = trainer.shard(samples)
    old_s = 0.0
    old = None
    if separate_old_pass:
        t0 = time.perf_counter()
        old = trainer.old_logprobs(mine)
        old_s = time.perf_counter() - t0
    result = trainer.train(mine, old)
    result["old_logprob_s"] = old_s
    if trainer.world_size > 1:
        import torch
        import torch.distributed as dist

        keys = ["gap_sum", "gap_n", "real_tokens", "total_tokens"]
        buf = torch.tensor([result[k] for k in keys], dtype=torch.float64,
                           device=trainer.device if trainer.device.type == "cuda" else "cpu")
        dist.all_reduce(buf)
        result.update(dict(zip(keys, buf.tolist(), strict=True)))
    return result


def follow(trainer: GRPOTrainer) -> None:
    """Ranks > 0: run every command rank 0 broadcasts until it says stop."""
    import torch.distributed as dist

    while True:
        payload = [None]
        dist.broadcast_object_list(payload, src=0)
        command = payload[0]
        if command[0] == "stop":
            return
        _, samples, separate_old_pass = command
        run_step(trainer, samples, separate_old_pass)


def main(argv: list[str] | None = None) -> int:
    """torchrun entrypoint: every rank builds a trainer; rank 0 also runs the orchestrator."""
    parser = argparse.ArgumentParser(prog="python -m rltune.workload.trainer")
    parser.add_argument("config")
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)

    import torch
    import torch.distributed as dist

    from rltune.errors import RltuneError
    from rltune.workload.config import load_workload_config
    from rltune.workload.orchestrator import run_job

    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        cfg = load_workload_config(args.config, args.overrides)
    except RltuneError as exc:
        print(f"rltune: {exc}", file=sys.stderr)
        return 2
    if world > 1 or "RANK" in os.environ:
        backend = "nccl" if torch.cuda.is_available() and resolve_device(cfg.trainer.device) == "cuda" else "gloo"
        dist.init_process_group(backend=backend)
    try:
        trainer = GRPOTrainer(cfg, rank, world)
        if rank == 0:
            run_job(cfg, args.run_dir, steps=args.steps, trainer=DistributedTrainer(trainer))
        else:
            with frozen_heap():  # as rank 0's steps run (run_job)
                follow(trainer)
    except RltuneError as exc:
        print(f"rltune: {exc}", file=sys.stderr)
        return 2
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
