"""docs/configuration.md, generated from the configuration models themselves.

    python -m deployments.config_reference > docs/configuration.md

Every `args:` key of serve_config.yaml: AppConfig's fields (pydantic descriptions and bounds)
and, under `engine:`, EngineConfig's (each field's `help`). tests/unit/test_config_reference.py
fails when the committed file differs from what this renders, so the reference cannot go
stale.
"""

from __future__ import annotations

import dataclasses

from pydantic.fields import FieldInfo

from deployments.config import AppConfig
from engine.engine_config import DEFAULT_MODEL_DIR, EngineConfig

HEADER = """# Configuration reference

Generated from `deployments/config.py` (`AppConfig`) and `engine/engine_config.py` (`EngineConfig`) by
`python -m deployments.config_reference > docs/configuration.md`; do not edit by hand. These are
the keys of `args:` in serve_config.yaml (`deployments.app:build_app`). Unknown keys, at the top
level or under `engine:`, fail the deploy naming the key, as do values the workers would refuse
(`deployments/app.py`); `python -m deployments.check_config serve_config.yaml` checks a file
without starting anything.
"""


def render() -> str:
    """The whole reference, Markdown."""
    top = [(name, _type(info.annotation), _default(_app_default(info)), _app_help(info))
           for name, info in AppConfig.model_fields.items()]
    engine = [(f.name, _type(f.type), _default(f.default), f.metadata["help"])
              for f in dataclasses.fields(EngineConfig)]
    return "\n".join([
        HEADER,
        "## Top level\n",
        _table(top),
        "\n## Under `engine:`\n",
        "The engine's own configuration; the cache budgets are per tensor-parallel rank.\n",
        _table(engine),
        "",
    ])


def _app_default(info: FieldInfo):
    return "the table below" if info.default_factory is not None else info.default


def _app_help(info: FieldInfo) -> str:
    bounds = [f"{name} {getattr(meta, attr)}" for meta in info.metadata
              for name, attr in (("≥", "ge"), (">", "gt"), ("length ≥", "min_length"))
              if getattr(meta, attr, None) is not None]
    return info.description + (f" ({', '.join(bounds)})" if bounds else "")


def _type(annotation) -> str:
    """"int | None" -> "int or None", a class -> its name (a table cell cannot hold "|")."""
    name = getattr(annotation, "__name__", None) if isinstance(annotation, type) else None
    return (name or str(annotation)).replace("typing.", "").replace(" | ", " or ")


def _default(value) -> str:
    if value is None:
        return "unset"
    if isinstance(value, tuple):
        return "[" + ", ".join(map(str, value)) + "]"
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1024 * 1024 and value % (1024 * 1024) == 0:
        return f"{value} ({value // (1024 * 1024)} MiB)"
    if value == str(DEFAULT_MODEL_DIR):
        return "the embedded tiny model"
    return str(value).lower() if isinstance(value, bool) else str(value)


def _table(rows: list[tuple[str, str, str, str]]) -> str:
    lines = ["| key | type | default | meaning |", "|---|---|---|---|"]
    lines += [f"| `{key}` | {kind} | {default} | {meaning} |" for key, kind, default, meaning in rows]
    return "\n".join(lines)


if __name__ == "__main__":
    print(render(), end="")
