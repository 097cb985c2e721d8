"""``launcher: torchrun``: ``python -m torch.distributed.run ... <script>`` run here as a local process group.

The argv is built by :func:`rltune.launch.launchers.launcher_argv`; starting, following, cancelling
and reattaching are the local launcher's (torchrun's own workers belong to the group it leads).
"""

from __future__ import annotations

from rltune.launch.local import LocalLauncher


class TorchrunLauncher(LocalLauncher):
    kind = "torchrun"


LAUNCHER = TorchrunLauncher
