"""IndexMap.record on small engines whose loaders do what real ones do (a supplement to tests/sync/test_vllm.py,
which records from vLLM's own loader): padded vocabularies, fused parameters, value transforms, foreign checkpoints."""

from __future__ import annotations

import pytest
import torch

from rltune.sync.format import IndexMapError
from rltune.sync.indexmap import IndexMap


class PaddedEngine(torch.nn.Module):
    """An embedding padded to a multiple of 8 rows whose loader zero-fills the padding (as vLLM's does),
    and a fused [a; b] parameter."""

    def __init__(self, dtype, vocab=13, hidden=4, scale=1):
        super().__init__()
        self.embed = torch.nn.Parameter(torch.zeros(-(-vocab // 8) * 8, hidden, dtype=dtype), requires_grad=False)
        self.fused = torch.nn.Parameter(torch.zeros(6, hidden, dtype=dtype), requires_grad=False)
        self.scale = scale

    @torch.no_grad()
    def load_weights(self, weights):
        for name, w in weights:
            if name == "embed":
                self.embed[: w.shape[0]].copy_(w * self.scale)
                self.embed[w.shape[0]:].fill_(0)
            elif name in ("a", "b"):
                rows = slice(0, 3) if name == "a" else slice(3, 6)
                self.fused[rows].copy_(w)
            else:
                raise KeyError(name)


SPEC = {"embed": ([13, 4], "bfloat16"), "a": ([3, 4], "bfloat16"), "b": ([3, 4], "bfloat16")}


@pytest.mark.parametrize("dtype", [torch.int64, torch.float64])
def test_padding_rows_are_engine_only_and_fused_halves_map_to_their_tensors(dtype):
    imap = IndexMap.record(lambda dt: PaddedEngine(dt), SPEC, placeholder_dtype=dtype)
    assert imap.engine_only == {"embed": 3 * 4}  # 16 rows held for 13: three zero rows nobody writes
    assert imap.tensors["embed"].held == 13 * 4
    a, b = imap.tensors["a"], imap.tensors["b"]
    # a and b are adjacent in the checkpoint and in the fused parameter: two runs, not one that crosses
    assert (a.ckpt_start.tolist(), a.length.tolist(), a.param_start.tolist()) == ([0], [12], [0])
    assert (b.ckpt_start.tolist(), b.length.tolist(), b.param_start.tolist()) == ([0], [12], [12])
    held, pid, pos = imap.tensors["embed"].locate(torch.arange(52).numpy())
    assert held.all() and (pos == torch.arange(52).numpy()).all()


def test_a_loader_that_computes_with_the_values_is_refused():
    with pytest.raises(IndexMapError, match="computes with checkpoint values"):
        IndexMap.record(lambda dt: PaddedEngine(dt, scale=0.5), SPEC, placeholder_dtype=torch.float64)


def test_a_checkpoint_of_another_model_names_its_source():
    with pytest.raises(IndexMapError, match=r"manifest\.json: the engine's load_weights refused.*another model"):
        IndexMap.record(lambda dt: PaddedEngine(dt), {**SPEC, "extra": ([2], "bfloat16")}, source="step/manifest.json")
    with pytest.raises(IndexMapError, match="no checkpoint tensor reaches engine parameter fused"):
        IndexMap.record(lambda dt: PaddedEngine(dt), {"embed": SPEC["embed"]}, source="step/manifest.json")
