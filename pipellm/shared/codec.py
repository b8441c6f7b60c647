"""The one wire codec: msgpack, never pickle. Messages are registered dataclasses.

A dataclass travels as a map with its registered name under "_t" and the fields that differ
from their defaults (the receiver's constructor fills in the rest); nested registered
dataclasses (e.g. SamplingParams inside a request) likewise. Token id arrays travel as packed
int32 bytes: a field holding `array('i')` becomes msgpack extension 1, `array('f')` (float32)
extension 2.
Decoding builds only registered classes through their constructors, so a peer can never make
this process run code, and a malformed message raises DecodeError.
"""

from __future__ import annotations

import dataclasses
import sys
from array import array
from typing import Any

import msgpack

_INT32, _FLOAT32 = 1, 2
_TYPECODES = {_INT32: "i", _FLOAT32: "f"}  # extension code -> array typecode
_CODES = {t: c for c, t in _TYPECODES.items()}
_REGISTRY: dict[str, type] = {}
_FIELDS: dict[type, tuple[tuple[str, Any], ...]] = {}  # a registered class's init fields
# and their defaults, looked up once
_REQUIRED = object()  # the default of a field that has none
_LITTLE = sys.byteorder == "little"


class DecodeError(ValueError):
    """Bytes that are not a well-formed message."""


def message(cls: type) -> type:
    """Class decorator: make `cls` a dataclass known to the codec by its name."""
    cls = cls if dataclasses.is_dataclass(cls) else dataclasses.dataclass(cls)
    _REGISTRY[cls.__name__] = cls
    return cls


def register(cls: type) -> type:
    """Register an existing dataclass (e.g. SamplingParams) for nesting inside messages."""
    _REGISTRY[cls.__name__] = cls
    return cls


def int32s(values) -> array:
    """Token ids as a packed int32 array (what the codec sends as bytes)."""
    return values if isinstance(values, array) and values.typecode == "i" else array("i", values)


def float32s(values) -> array:
    return array("f", values)


def encode(msg: Any) -> bytes:
    return msgpack.packb(msg, default=_default, use_bin_type=True)


def decode(data: bytes) -> Any:
    try:
        return msgpack.unpackb(data, ext_hook=_ext_hook, object_hook=_object_hook, raw=False,
                               strict_map_key=True)
    except DecodeError:
        raise
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError,
            msgpack.StackError) as e:
        raise DecodeError(f"malformed message: {e}") from None


def _default(obj: Any) -> Any:
    if isinstance(obj, array):
        code = _CODES.get(obj.typecode)
        if code is None:
            raise TypeError(f"array typecode {obj.typecode!r} cannot be sent")
        if not _LITTLE:  # the wire is little-endian
            obj = array(obj.typecode, obj)
            obj.byteswap()
        return msgpack.ExtType(code, obj.tobytes())
    fields = _FIELDS.get(type(obj))
    if fields is None and dataclasses.is_dataclass(obj) and type(obj).__name__ in _REGISTRY:
        fields = _FIELDS[type(obj)] = tuple((f.name, _default_of(f))
                                            for f in dataclasses.fields(obj) if f.init)
    if fields is None:
        raise TypeError(f"{type(obj).__name__} is not a registered message")
    out = {"_t": type(obj).__name__}
    for name, default in fields:
        value = getattr(obj, name)
        if value is not default and (default is _REQUIRED or value != default):
            out[name] = value
    return out


def _default_of(f: dataclasses.Field) -> Any:
    """The value a field takes when a message leaves it out (_REQUIRED: it never does)."""
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return _REQUIRED


def _ext_hook(code: int, data: bytes) -> array:
    typecode = _TYPECODES.get(code)
    if typecode is None or len(data) % 4:
        raise DecodeError(f"bad extension {code} of {len(data)} bytes")
    out = array(typecode, data)
    if not _LITTLE:
        out.byteswap()
    return out


def _object_hook(obj: dict) -> Any:
    name = obj.pop("_t", None)
    if name is None:
        return obj
    cls = _REGISTRY.get(name)
    if cls is None:
        raise DecodeError(f"unknown message type {name!r}")
    try:
        return cls(**obj)
    except (TypeError, ValueError) as e:
        raise DecodeError(f"bad {name}: {e}") from None
