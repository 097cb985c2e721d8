"""GRPO's two formulas: group-relative advantages and the clipped policy loss.

Shape suffixes: ``_G`` one entry per trial of a group, ``_T`` one per token, ``_BT`` a batch of
token rows. Pure functions of tensors, so tests check them on hand-computed values.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

ADV_EPS = 1e-6


def group_advantages(rewards_G: torch.Tensor, normalize_std: bool = True) -> torch.Tensor:
    """(r - mean(r)) / (std(r) + eps) within one group; std is the population std (ddof 0).

    A group whose rewards are all equal has zero advantages: it teaches nothing, which is why the
    environments give partial credit.
    """
    import torch

    rewards_G = rewards_G.to(torch.float64)
    centred = rewards_G - rewards_G.mean()
    if not normalize_std:
        return centred
    return centred / (rewards_G.std(unbiased=False) + ADV_EPS)


def clipped_policy_loss(logp_new_BT: torch.Tensor, logp_old_BT: torch.Tensor, advantages: torch.Tensor,
                        mask_BT: torch.Tensor, clip_eps: float, token_count: int | None = None
                        ) -> tuple[torch.Tensor, dict[str, float]]:
    """Token-level clipped surrogate: -mean over masked tokens of min(ratio*A, clip(ratio)*A).

    ``token_count`` is the denominator (all loss tokens of the mini-batch), so micro-batches can be
    summed into the same loss the whole mini-batch would give. ``advantages`` is one value per row
    (``_B``, padded rows) or per token (``_BT``, packed rows hold several samples). Returns (loss, stats) where stats
    holds the clipped fraction and the mean ratio over the masked tokens of this call.
    """
    import torch

    mask = mask_BT.to(logp_new_BT.dtype)
    ratio = torch.exp(logp_new_BT - logp_old_BT)
    adv = advantages.to(logp_new_BT.dtype)
    if adv.dim() == 1:
        adv = adv.unsqueeze(-1)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * adv
    per_token = -torch.minimum(unclipped, clipped)
    denom = float(token_count) if token_count is not None else float(mask.sum().clamp(min=1))
    loss = (per_token * mask).sum() / denom
    with torch.no_grad():
        n = mask.sum().clamp(min=1)
        stats = {
            "clip_frac": float(((clipped != unclipped).to(mask.dtype) * mask).sum() / n),
            "ratio_mean": float((ratio * mask).sum() / n),
        }
    return loss, stats
