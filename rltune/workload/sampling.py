"""Sampling whose draws belong to the request, not to the batch it happened to share.

An engine serving many trials at once would, with one random generator, hand each row whatever
draw came next: which token a trial samples would depend on which other requests were running and
in what order they arrived, which depends on thread timing. Two runs of one job with one seed then
learn differently, and on a loaded machine more so; the reward check (rltune.tune.reward_check),
whose untuned seeds and reverted runs must repeat each other, cannot tell a change from that.

Here every draw is a function of three integers: the request's key (its task, trial and turn,
hashed by :func:`request_key`, mixed with the job's seed), the position of the token in the
request's answer, and the vocabulary entry. A counter-based hash (splitmix64's finaliser, on int64
tensors, so one vectorised pass serves a whole batch on a CPU or a GPU) turns them into a uniform,
and the Gumbel-max trick turns the uniforms of a row into one sample of its softmax: ``argmax(logp
- log(-log u))`` is distributed as ``Categorical(exp(logp))``.
"""

from __future__ import annotations

import hashlib

_MASK64 = (1 << 64) - 1


def _signed(value: int) -> int:
    value &= _MASK64
    return value - (1 << 64) if value >> 63 else value


# splitmix64's constants as int64 values (torch's int64 multiplication wraps modulo 2**64).
_GOLDEN = _signed(0x9E3779B97F4A7C15)
_M1 = _signed(0xBF58476D1CE4E5B9)
_M2 = _signed(0x94D049BB133111EB)


def request_key(name: str) -> int:
    """A request's 63-bit key from its name (say ``"t12:3:0"``: task, trial, turn); stable across
    processes and Python versions (``hash`` of a str is salted per process)."""
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little") >> 1


def seeded_key(seed: int, key: int) -> int:
    """The key of a request in a job with sampling seed ``seed``."""
    return _signed(mix64(_signed(seed * 0x9E3779B97F4A7C15) ^ key))


def mix64(x: int) -> int:
    """splitmix64's finaliser on one Python int (the reference :func:`mix64_tensor` must equal)."""
    x &= _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def mix64_tensor(x):
    """:func:`mix64` elementwise on an int64 tensor (shifts made logical by masking the sign's copies)."""
    x = (x ^ ((x >> 30) & ((1 << 34) - 1))) * _M1
    x = (x ^ ((x >> 27) & ((1 << 37) - 1))) * _M2
    return x ^ ((x >> 31) & ((1 << 33) - 1))


def uniforms(keys, positions, vocab: int):
    """``[B, vocab]`` float64 uniforms in (0, 1): row ``b``'s depend only on ``keys[b]`` and ``positions[b]``."""
    import torch

    row = mix64_tensor(keys * _GOLDEN + positions)
    column = torch.arange(vocab, device=keys.device, dtype=torch.int64) * _M1
    bits = mix64_tensor(row.unsqueeze(-1) + column)
    return ((bits >> 11) & ((1 << 53) - 1)).to(torch.float64).add_(0.5).mul_(2.0 ** -53)


def sample(logp, keys, positions):
    """One token per row of the log-probabilities ``logp`` [B, V], drawn with the rows' own uniforms."""
    import torch

    gumbel = -torch.log(-torch.log(uniforms(keys, positions, logp.shape[-1])))
    return torch.argmax(logp.double() + gumbel, dim=-1)
