"""rltune: make LLM RL post-training steps faster on the GPUs you already have.

Three parts: the tuner (profile → propose → predict → trial → auto), sparse delta weight
sync (``rltune.sync``) and a small but real GRPO reference workload (``rltune.workload``).
Importing this package is cheap: heavy libraries load only where they are used.
"""

__version__ = "0.1.0"
