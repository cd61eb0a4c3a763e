"""The SoC table (mirrored from the C++ core, csrc/ascendc/soc.cpp).

Tiling is computed for a chosen Ascend SoC exactly as it would be for that
chip (core count, Unified Buffer size, bf16 support); the kernels then run
those tiles on this CPU. ``host`` is this machine, tuned for speed.
"""
from __future__ import annotations

from atb import _C

_default = "host"
_cache: dict[str, _C.SocInfo] = {}


def soc_names() -> list[str]:
    """Canonical SoC names (aliases ``Ascend910B``, ``Ascend910ProB``, ``Ascend310P`` also accepted)."""
    return list(_C.soc_names())


def get_soc(name: str | None = None) -> _C.SocInfo:
    """The SocInfo for ``name`` (default: the one set by :func:`set_soc`), matched in any case;
    ``.name`` is the canonical spelling (``get_soc("ascend910b4").name == "Ascend910B4"``).

    Raises ValueError listing the valid names for an unknown SoC.
    """
    name = _default if name is None else name
    if not isinstance(name, str):
        raise TypeError(f"soc_type must be a str such as 'Ascend910B4' or 'host', got {type(name).__name__}")
    key = name.lower()
    info = _cache.get(key)
    if info is None:
        info = _cache[key] = _C.get_soc(name)
    return info


def set_soc(name: str) -> None:
    """Sets the SoC every kernel tiles for when its ``soc_type`` is None (any case; kept canonical)."""
    global _default
    _default = get_soc(name).name


def default_soc() -> str:
    return _default


def _forget_host() -> None:
    """The host entry depends on the thread count; drop it when that changes."""
    _cache.pop("host", None)
