"""A real TRL GRPO job that needs no download: ``python -m rltune.integrations.trl_grpo [flags]``.

TRL's own ``GRPOTrainer`` trains a randomly initialised Qwen3 (built from a config, seeded) with a
character tokenizer built with the ``tokenizers`` library, on arithmetic prompts with a Python
reward -- the reference workload's math tasks and partial-credit reward (:mod:`rltune.workload.envs`).
:class:`~rltune.integrations.trl.TrlStageTimers` logs the stage times.

Flags are TRL's: every ``GRPOConfig`` field (``--per_device_train_batch_size 8``, ``--use_vllm
true``, ...) and ``--config file.yaml``, parsed by TRL's ``TrlParser``, plus the job's own
(:class:`JobArguments`: the model's shape, the number of prompts, and ``--samples_per_step``).

``--samples_per_step N`` holds the batch fixed the way a job's workload does: the completions one
optimizer step trains (tasks x generations). The job then sets ``gradient_accumulation_steps`` to
``N / (per_device_train_batch_size x processes)``, so a larger micro-batch means fewer accumulation
steps, never a bigger batch. Set ``generation_batch_size`` as a multiple of N to generate for
several optimizer steps at once (TRL derives its ``steps_per_generation`` from it).

A flag neither TRL nor the job knows, or a value TRL refuses, ends the job with one line on stderr
and exit code 2. Example (CPU)::

    python -m rltune.integrations.trl_grpo --output_dir runs/trl --max_steps 5 --bf16 false \\
        --samples_per_step 16 --per_device_train_batch_size 8 --num_generations 4 --report_to none
"""

from __future__ import annotations

import os
import sys
import warnings
from dataclasses import dataclass, field

PROG = "rltune.integrations.trl_grpo"


@dataclass
class JobArguments:
    """The job's own flags (GRPOConfig has every other)."""

    model_layers: int = field(default=2, metadata={"help": "decoder layers of the random Qwen3"})
    model_hidden: int = field(default=128, metadata={"help": "hidden size"})
    model_heads: int = field(default=4, metadata={"help": "attention heads"})
    model_kv_heads: int = field(default=2, metadata={"help": "key/value heads"})
    model_head_dim: int = field(default=32, metadata={"help": "dimension of one head"})
    model_intermediate: int = field(default=0, metadata={"help": "MLP size (0: 3 x hidden)"})
    num_tasks: int = field(default=256, metadata={"help": "arithmetic prompts in the dataset"})
    task_seed: int = field(default=0, metadata={"help": "seed of the prompts (the model's is --seed)"})
    model_seed: int = field(default=-1, metadata={
        "help": "seed of the model's random initialisation (-1: --seed); fixed, runs of several --seed start from one model"})
    max_operand: int = field(default=99, metadata={"help": "operands are drawn from 0..max_operand (9: one-digit tasks)"})
    max_terms: int = field(default=3, metadata={"help": "a task has 2..max_terms operands"})
    operators: str = field(default="+-*", metadata={"help": "the operators a task may use, any of '+-*'"})
    samples_per_step: int = field(default=0, metadata={
        "help": "completions per optimizer step; sets gradient_accumulation_steps from the micro-batch (0: leave it)"})


class JobFlagError(Exception):
    """A flag or value the job cannot run with; printed as one line, exit code 2."""


def parse(argv: list[str]):
    """(GRPOConfig, JobArguments) from ``argv``; raises JobFlagError with the fix."""
    from trl import GRPOConfig, TrlParser

    parser = TrlParser((GRPOConfig, JobArguments), prog=PROG)
    # Deprecation warnings the configs raise while they are built (transformers renames fields) are
    # shown only once the flags are good: a bad flag's one line must stay one line.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        argv = with_derived_accumulation(parser, list(argv))
        try:
            config, job, rest = parser.parse_args_and_config(argv, return_remaining_strings=True)
        except ValueError as exc:  # GRPOConfig / TrainingArguments refuse the combination
            message = " ".join(str(exc).split())
            if "use_cpu" in message or "bf16" in message.lower() and "gpu" in message.lower():
                message += " (on a CPU pass --bf16 false)"
            raise JobFlagError(message) from None
    if rest:
        raise JobFlagError(f"{' '.join(rest)}: not a flag of TRL's GRPOConfig or of this job; check the spelling "
                           "(if it comes from a job file: its launch.knob_map or launch.command); "
                           f"'python -m {PROG} --help' lists them")
    for warning in caught:
        warnings.showwarning(warning.message, warning.category, warning.filename, warning.lineno)
    return config, job


def with_derived_accumulation(parser, argv: list[str]) -> list[str]:
    """``argv`` with ``--gradient_accumulation_steps`` set from ``--samples_per_step``.

    It must be on the command line before GRPOConfig is built: TRL derives its generation batch
    and steps_per_generation from the accumulation in the config's own checks.
    """
    import yaml

    probe = list(argv)
    values: dict = {}
    if "--config" in probe:  # TrlParser's own config file: its values are the flags' defaults
        at = probe.index("--config")
        with open(probe[at + 1]) as handle:
            values = yaml.safe_load(handle) or {}
        del probe[at:at + 2]
        values.pop("env", None)
        parser.set_defaults_with_config(**values)
    known, _ = parser.parse_known_args(probe)
    if known.samples_per_step <= 0:
        return argv
    per_step = known.per_device_train_batch_size * int(os.environ.get("WORLD_SIZE", "1"))
    if known.samples_per_step % per_step:
        raise JobFlagError(f"--samples_per_step {known.samples_per_step} is not a multiple of "
                           f"per_device_train_batch_size x processes ({per_step}); pick a micro-batch that divides it")
    accumulation = known.samples_per_step // per_step
    explicit = "--gradient_accumulation_steps" in probe or "gradient_accumulation_steps" in values
    if explicit and known.gradient_accumulation_steps != accumulation:
        raise JobFlagError(f"--gradient_accumulation_steps {known.gradient_accumulation_steps} contradicts "
                           f"--samples_per_step {known.samples_per_step} at micro-batch {per_step}; give one of them")
    return [*argv, "--gradient_accumulation_steps", str(accumulation)]


def build_tokenizer():
    """A character-level fast tokenizer over the reference workload's alphabet (one token per character)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from rltune.workload.tokenizer import ALPHABET, BOS, EOS, PAD, SPECIAL_TOKENS, UNK

    vocab = {token: i for i, token in enumerate([*SPECIAL_TOKENS, *ALPHABET])}
    core = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token=PAD, bos_token=BOS, eos_token=EOS, unk_token=UNK)


def build_model(job: JobArguments, tokenizer, seed: int):
    """A Qwen3 causal LM of the job's shape, randomly initialised from ``seed``."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=job.model_hidden,
        intermediate_size=job.model_intermediate or 3 * job.model_hidden, num_hidden_layers=job.model_layers,
        num_attention_heads=job.model_heads, num_key_value_heads=job.model_kv_heads, head_dim=job.model_head_dim,
        max_position_embeddings=1024, tie_word_embeddings=False, rope_theta=10000.0,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(config)


def build_dataset(job: JobArguments):
    import random

    from datasets import Dataset

    from rltune.workload.envs import make_math_task

    rng = random.Random(job.task_seed)
    tasks = [make_math_task(rng, f"t{i}", job.max_operand, job.max_terms, job.operators) for i in range(job.num_tasks)]
    return Dataset.from_dict({"prompt": [t.prompt for t in tasks], "answer": [t.answer for t in tasks]})


def arithmetic_reward(completions: list[str], answer: list[str], **kwargs) -> list[float]:
    """1 for the exact integer, partial credit otherwise (the reference workload's math reward)."""
    from rltune.workload.envs import partial_credit

    return [partial_credit(text, truth) for text, truth in zip(completions, answer, strict=True)]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        config, job = parse(argv)
    except JobFlagError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    from trl import GRPOTrainer

    from rltune.integrations.trl import attach

    tokenizer = build_tokenizer()
    model = build_model(job, tokenizer, config.seed if job.model_seed < 0 else job.model_seed)
    print(f"{PROG}: Qwen3 {job.model_layers} x {job.model_hidden}, "
          f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f} M parameters; "
          f"micro-batch {config.per_device_train_batch_size} x {config.gradient_accumulation_steps} accumulation "
          f"x {config.world_size} processes, generation batch {config.generation_batch_size} "
          f"(steps_per_generation {config.steps_per_generation}), num_iterations {config.num_iterations}",
          flush=True)
    trainer = GRPOTrainer(model=model, reward_funcs=[arithmetic_reward], args=config,
                          train_dataset=build_dataset(job), processing_class=tokenizer)
    attach(trainer)
    trainer.train()
    trainer.save_state()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
