"""Write every config key prime-rl's ``rl`` entrypoint accepts, one dotted snake_case path a line.

Run with prime-rl's slim config package installed (it needs Python 3.12), from a checkout of
PrimeIntellect-ai/prime-rl at the commit to record::

    python3.12 -m venv /tmp/prl && /tmp/prl/bin/pip install ./packages/prime-rl-configs
    /tmp/prl/bin/python extract_config_keys.py <commit> > rl_config_keys.txt

The walk starts at ``prime_rl.configs.rl.RLConfig`` and descends through every field whose type
is a config class: optional sub-configs, every variant of a discriminated union (the variant's
``type`` value is named on its lines), and list items (written ``N``, as the CLI's
``--orchestrator.train.source.0.args`` indexes them). A path is written once, with the types
seen at it. The CLI takes the same paths in kebab case (``--trainer.model.seq-len``).
"""

from __future__ import annotations

import sys
import types
import typing

from pydantic import BaseModel


def _members(annotation):
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _members(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        return [m for arg in typing.get_args(annotation) for m in _members(arg)]
    return [annotation]


def _describe(annotation) -> str:
    text = getattr(annotation, "__name__", None) if not typing.get_args(annotation) else None
    return text or str(annotation).replace("typing.", "")


def walk(model: type[BaseModel], prefix: str, out: dict[str, set[str]], seen: tuple = ()) -> None:
    for name, info in model.model_fields.items():
        path = f"{prefix}{name}"
        for member in _members(info.annotation):
            origin = typing.get_origin(member)
            if isinstance(member, type) and issubclass(member, BaseModel):
                variant = member.model_fields.get("type")
                tag = f" type={variant.default}" if variant is not None and isinstance(variant.default, str) else ""
                out.setdefault(path, set()).add(f"{member.__name__}{tag}")
                if member not in seen:
                    walk(member, path + ".", out, seen + (member,))
            elif origin in (list, tuple) and typing.get_args(member):
                out.setdefault(path, set()).add(_describe(member))
                for item in _members(typing.get_args(member)[0]):
                    if isinstance(item, type) and issubclass(item, BaseModel) and item not in seen:
                        walk(item, path + ".N.", out, seen + (item,))
            else:
                out.setdefault(path, set()).add(_describe(member))


def main() -> None:
    from prime_rl.configs.rl import RLConfig

    commit = sys.argv[1] if len(sys.argv) > 1 else "unknown"
    out: dict[str, set[str]] = {}
    walk(RLConfig, "", out)
    print(f"# prime-rl rl entrypoint config keys (prime_rl.configs.rl.RLConfig) at PrimeIntellect-ai/prime-rl@{commit}")
    print("# path<TAB>types (config classes with their discriminator value); CLI spelling is kebab case")
    for path in sorted(out):
        print(f"{path}\t{' | '.join(sorted(out[path]))}")


if __name__ == "__main__":
    main()
