"""How config classes become flags and env vars: the machinery behind `pipellm/shared/config/`.

Every field `foo_bar` of a config class is the flag `--foo-bar` and the env var
`PIPELLM_FOO_BAR`; precedence: flag > env var > default. A field holding another config class
(`EngineConfig.sim`) contributes its fields under its name (`--sim-gpu`, `PIPELLM_SIM_GPU`),
or, made with `setting(flat=True)` (`EngineConfig.scheduler`), under their own names: the class
then only groups them in code (`--max-running`, `config.scheduler.max_running`). A field typed
as a str-valued `enum.Enum` is a text flag; its config class parses the text.
Fields made with `setting(...)` carry a help text, a group for `--help`, and optionally the
name vLLM gives the same thing (`--max-num-seqs` for `--max-running`).
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import json
import os
import types
import typing
from collections.abc import Iterator

_METAVARS = {int: "N", float: "X", str: "TEXT"}


def setting(default=dataclasses.MISSING, help: str = "", *, group: str = "", alias: str = "",
            default_factory=dataclasses.MISSING, flat: bool = False, many: bool = False,
            by_device: bool = False):
    """A config field: its default, the one-line help of its flag, its --help group, and
    `alias`, the flag vLLM users know it by (without the dashes). `flat`, for a field holding
    a config class: its settings keep their own names, not prefixed with the field's. `many`,
    for a str setting: its flag takes one or more values (vLLM's nargs="+"), joined by a
    space. `by_device`: the flag's default is unset, and a command line that leaves it so gets
    the device's value at start-up (`unset_by_device`); code that builds the config gets
    `default`."""
    return dataclasses.field(default=default, default_factory=default_factory,
                             metadata={"help": help, "group": group, "alias": alias,
                                       "flat": flat, "many": many, "by_device": by_device})


def add_config_args(parser: argparse.ArgumentParser, cls: type,
                    only: tuple[str, ...] | None = None) -> None:
    """One flag per setting of `cls` (or of those named in `only`), in its group, defaulting
    to its env var or its default."""
    for dest, f, typ in _leaf_fields(cls):
        if only is not None and dest not in only:
            continue
        env = os.environ.get(_env_name(dest))
        default = f.default if env is None else _parse(typ, env)
        if env is None and f.metadata.get("by_device"):
            default = None
        if isinstance(default, enum.Enum):
            default = default.value
        flags = ["--" + dest.replace("_", "-")]
        if f.metadata.get("alias"):
            flags.append("--" + f.metadata["alias"])
        help = f.metadata.get("help", "")
        shown = "by device" if f.metadata.get("by_device") else "unset"
        help += f" (default: {shown if default is None else default!r}"
        help += f", from {_env_name(dest)})" if env is not None else ")"
        group = _group(parser, f.metadata.get("group") or "other")
        if typ is bool:
            group.add_argument(*flags, dest=dest, action=argparse.BooleanOptionalAction,
                               default=default, help=help.replace("%", "%%"))
        else:
            many = {"nargs": "+", "action": _JoinValues} if f.metadata.get("many") else {}
            group.add_argument(*flags, dest=dest, type=typ, default=default,
                               help=help.replace("%", "%%"), metavar=_METAVARS[typ], **many)


class _JoinValues(argparse.Action):
    """A `many` setting's values, joined by a space."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, " ".join(values))


def config_from_args(cls: type, args: argparse.Namespace, **overrides):
    """Build the frozen config `cls` from parsed flags (and explicit overrides, named as in
    `with_settings`); a `by_device` setting left unset takes its field's default."""
    unset = set(unset_by_device(cls, args))
    values = {dest: getattr(args, dest) for dest, _, _ in _leaf_fields(cls)
              if hasattr(args, dest) and dest not in unset}
    return _build(cls, {**values, **overrides})


def unset_by_device(cls: type, args: argparse.Namespace) -> list[str]:
    """The `by_device` settings of `cls` that neither a flag nor an env var set."""
    return [dest for dest, f, _ in _leaf_fields(cls)
            if f.metadata.get("by_device") and getattr(args, dest, 0) is None]


def with_settings(config, **changes):
    """`config` with some settings changed, each named as its flag's destination:
    `with_settings(c, sim_clock="virtual")` is --sim-clock, so it sets `c.sim.clock`."""
    return _build(type(config), {**settings(config), **changes})


def settings(config, prefix: str = "") -> dict:
    """Every setting of `config`, named as its flag's destination (`sim_clock`)."""
    out = {}
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if dataclasses.is_dataclass(value):
            out.update(settings(value, _nested_prefix(f, prefix)))
        else:
            out[prefix + f.name] = value
    return out


def env_for(config) -> dict[str, str]:
    """The PIPELLM_* env vars that reproduce `config` in a child process (None: unset)."""
    return {_env_name(dest): str(int(value)) if isinstance(value, bool) else str(value)
            for dest, value in settings(config).items() if value is not None}


def _leaf_fields(cls: type, prefix: str = "") -> Iterator[tuple[str, dataclasses.Field, type]]:
    """(destination, field, type) of each setting of `cls`; a field holding a config class
    contributes its own settings, named with its name as a prefix (unless it is flat)."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        typ = _base_type(hints[f.name])
        if dataclasses.is_dataclass(typ):
            yield from _leaf_fields(typ, _nested_prefix(f, prefix))
        else:
            yield prefix + f.name, f, typ


def _build(cls: type, values: dict):
    if unknown := values.keys() - {d for d, _, _ in _leaf_fields(cls)}:
        raise TypeError(f"{cls.__name__} has no setting {', '.join(sorted(unknown))}")
    return _construct(cls, values, "")


def _construct(cls: type, values: dict, prefix: str):
    kwargs = {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        typ = _base_type(hints[f.name])
        if dataclasses.is_dataclass(typ):
            kwargs[f.name] = _construct(typ, values, _nested_prefix(f, prefix))
        elif prefix + f.name in values:
            kwargs[f.name] = values[prefix + f.name]
    return cls(**kwargs)


def _nested_prefix(f: dataclasses.Field, prefix: str) -> str:
    """The prefix of the settings of the config class in field `f`."""
    return prefix if f.metadata.get("flat") else f"{prefix}{f.name}_"


def _group(parser: argparse.ArgumentParser, title: str):
    for group in parser._action_groups:
        if group.title == title:
            return group
    return parser.add_argument_group(title)


def _env_name(dest: str) -> str:
    return "PIPELLM_" + dest.upper()


def _base_type(hint) -> type:
    """The type a flag parses: X of `X | None`; str for a str-valued enum (its config class
    turns the text into the enum, with a message naming the choices)."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    if isinstance(hint, type) and issubclass(hint, enum.Enum) and issubclass(hint, str):
        return str
    return hint


def _parse(typ: type, text: str):
    if typ is bool:
        return text.strip().lower() in ("1", "true", "yes", "on")
    return typ(text)


def json_object(flag: str, text: str) -> dict:
    """The JSON object a flag's value holds (vLLM's JSON flags); a ValueError naming the flag
    for text that is not JSON or not an object."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{flag} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{flag} must be a JSON object")
    return value
