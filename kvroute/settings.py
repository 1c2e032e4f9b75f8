"""Settings from flags and ``KVROUTE_*`` environment variables, built in one place per process.

A process declares its settings as a frozen dataclass whose fields carry a help text
(``setting(default, "help")``); :func:`load_settings` turns every field ``foo_bar`` into the flag
``--foo-bar`` and the variable ``KVROUTE_FOO_BAR``. Precedence: flag, then environment, then the
default. Nothing else in the code base reads the environment (the OpenTelemetry SDK reads its own
``OTEL_*`` variables).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")
ENV_PREFIX = "KVROUTE_"


def setting(default: Any, help: str, *, choices: Sequence[str] | None = None, secret: bool = False) -> Any:  # noqa: A002
    """A dataclass field with a help text (and optional choices) for the flag; a ``secret`` one
    (a password, a token) is left out of the settings' ``repr``."""
    return dataclasses.field(default=default, repr=not secret, metadata={"help": help, "choices": choices})


def secret_from(settings: Any, name: str) -> str | None:
    """A secret given either as the setting ``name`` (best from its ``KVROUTE_*`` variable) or as
    the first line of the file the setting ``{name}_file`` names; None when neither is set.

    Raises:
        ValueError: both are set, or the file cannot be read or is empty (the message names the
            setting, never the secret).
    """
    value = getattr(settings, name) or None
    path = getattr(settings, f"{name}_file")
    if not path:
        return value
    if value is not None:
        raise ValueError(f"{name}, {name}_file: set one, not both")
    return read_secret_file(path, f"{name}_file")


def read_secret_file(path: str, what: str) -> str:
    """The first line of the file ``path`` holding a secret; ``what`` names the setting or flag
    that gave the path in an error.

    Raises:
        ValueError: the file cannot be read or its first line is empty (the message starts with
            ``what``, never holds the secret).
    """
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as e:
        raise ValueError(f"{what}: cannot read {path} ({e.strerror})") from e
    if not lines or not lines[0]:
        raise ValueError(f"{what}: {path} is empty")
    return lines[0]


def _base_type(tp: Any) -> type:
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0]
    return tp


def _parse_bool(text: str) -> bool:
    v = text.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected a boolean (true/false), got {text!r}")


def _convert(field: dataclasses.Field, text: str, hints: Mapping[str, Any]) -> Any:
    tp = _base_type(hints[field.name])
    if text == "" and type(None) in typing.get_args(hints[field.name]):
        return None
    if tp is bool:
        return _parse_bool(text)
    if tp in (int, float, str):
        return tp(text)
    if typing.get_origin(tp) in (list, tuple):
        return tuple(s.strip() for s in text.split(",") if s.strip())
    raise TypeError(f"unsupported setting type {tp!r}")


def add_arguments(parser: argparse.ArgumentParser, cls: type) -> None:
    """Add one ``--flag`` per field of the settings dataclass ``cls`` (defaults resolved later); a
    boolean one is a switch pair, ``--flag`` / ``--no-flag``, as vLLM's are (its variable takes
    true/false)."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        env = ENV_PREFIX + f.name.upper()
        default = f.default if f.default is not dataclasses.MISSING else None
        help_text = f"{f.metadata.get('help', '')} [env {env}; default {default!r}]".replace("%", "%%")
        flag = "--" + f.name.replace("_", "-")
        if _base_type(hints[f.name]) is bool:
            parser.add_argument(flag, dest=f.name, default=None, help=help_text, action=argparse.BooleanOptionalAction)
            continue
        parser.add_argument(flag, dest=f.name, default=None, help=help_text, choices=f.metadata.get("choices"))


def settings_from(cls: type[T], args: argparse.Namespace | None, env: Mapping[str, str] | None = None) -> T:
    """Build ``cls`` from parsed flags, then ``KVROUTE_*`` variables of ``env``, then defaults.

    Raises:
        ValueError: a value does not parse (the message names the flag and the variable).
    """
    env = os.environ if env is None else env
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        raw = getattr(args, f.name, None) if args is not None else None
        source = "--" + f.name.replace("_", "-")
        if raw is None:
            raw = env.get(ENV_PREFIX + f.name.upper())
            source = ENV_PREFIX + f.name.upper()
        if raw is None:
            continue
        if isinstance(raw, bool):  # a switch (--flag / --no-flag) parsed by argparse
            values[f.name] = raw
            continue
        try:
            values[f.name] = _convert(f, raw, hints)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{source}: {e}") from e
        choices = f.metadata.get("choices")
        if choices and values[f.name] not in choices:
            raise ValueError(f"{source}: expected one of {', '.join(choices)}, got {values[f.name]!r}")
    return cls(**values)


def load_settings(cls: type[T], argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None,
                  prog: str | None = None, description: str | None = None) -> T:
    """Parse ``argv`` (sys.argv[1:] when None) into ``cls``; ``--help`` lists every flag and variable."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    add_arguments(parser, cls)
    return settings_from(cls, parser.parse_args(argv), env)
