"""Command-line overrides checked the way the trainer's own Hydra app checks them.

NeMo's scripts run under ``hydra_runner``: Hydra composes the script's config with the overrides on the
command line and refuses an unknown key without ``+``, a ``+`` on an existing key, or bad override
syntax.  :func:`compose` runs Hydra's own composition (hydra-core, NeMo 24.12's version) on the
profile's vendored config, so a refused override is refused here, before any capacity is requested,
with Hydra's message.  Hydra does not check types (the config is untyped YAML), so a changed value must
also have the type of the default it replaces: an int for an int, a number for a float, a list for a
list.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Sequence
from functools import cache
from pathlib import Path
from typing import Any

from retrain.trainers import PlanError

_PLAIN = re.compile(r"^[A-Za-z0-9_./:+-]+$")


def hydra_string(value: str) -> str:
    """``value`` as a Hydra override value: bare when the grammar reads it back unchanged, else quoted.

    Quoting does not stop interpolation: Hydra's grammar keeps ``${...}`` inside a quoted value, and
    OmegaConf resolves it when the trainer reads the key (``${oc.env:...}`` reads the pod's environment),
    so a value holding ``${`` is refused; no name this project writes holds one."""
    if "${" in value:
        raise PlanError(f"{value!r} holds '${{', which Hydra would resolve as an interpolation")
    if (
        _PLAIN.match(value)
        and not re.match(r"^[-+]?[0-9.]", value)
        and value.lower() not in ("true", "false", "null")
    ):
        return value
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def hydra_blend(blend: Sequence[float | str], mount: Callable[[str], str]) -> str:
    """Megatron's blend ``(weight, prefix, ...)`` as a Hydra list's items, prefixes at their pod paths."""
    return ",".join(
        hydra_string(mount(item)) if isinstance(item, str) else repr(float(item)) for item in blend
    )


#: Hydra's global state is per process; compositions take turns.
_LOCK = threading.Lock()
#: Hydra's modules import one another in a circle.  Two threads entering the circle at different modules
#: at once (a NeMo and a Megatron-Bridge run handed over together, in one function server) met Python's
#: import-deadlock check: "_DeadlockError: deadlock detected by _ModuleLock('hydra._internal.
#: config_loader_impl')", and the run failed.  One thread imports it all first, from the top.
_IMPORTING = threading.Lock()
HYDRA_MODULES = (
    "hydra",
    "hydra.errors",
    "hydra._internal.config_loader_impl",
    "hydra.core.override_parser.overrides_parser",
    "omegaconf",
    "omegaconf.errors",
)


def load_hydra() -> None:
    """Import Hydra's modules that retrain uses, one thread at a time; call before importing any of them."""
    import importlib

    with _IMPORTING:
        for name in HYDRA_MODULES:
            importlib.import_module(name)


def _compose(config_dir: Path, config_name: str, overrides: Sequence[str]) -> Any:
    """Only through :func:`compose`, which has loaded Hydra (``load_hydra``)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    with _LOCK, initialize_config_dir(config_dir=str(config_dir.resolve()), version_base=None):
        try:
            return hydra_compose(config_name=config_name, overrides=list(overrides))
        except (HydraException, OmegaConfBaseException) as e:
            raise PlanError(" ".join(str(e).split())) from None


@cache
def _defaults(config_dir: Path, config_name: str) -> Any:
    return _compose(config_dir, config_name, [])


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list | tuple):
        return "list"
    if isinstance(value, dict):
        return "map"
    return type(value).__name__


def _type_problem(key: str, default: Any, value: Any) -> str | None:
    want, got = _kind(default), _kind(value)
    if want == "null" or want == got or (want == "number" and got == "integer"):
        return None
    return f"override {key}={value!r}: a {got} where the config's default ({default!r}) is a {want}"


def compose(config_dir: Path, config_name: str, overrides: Sequence[str]) -> Any:
    """The ``DictConfig`` the trainer would compose; PlanError for an override it would refuse."""
    load_hydra()
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
    except HydraException as e:
        raise PlanError(" ".join(str(e).split())) from None
    defaults = _defaults(config_dir, config_name)
    for o in parsed:
        if o.is_add() or o.is_force_add() or o.is_delete():
            continue
        default = _default(defaults, o.key_or_group)
        if default is not _UNTYPED and (problem := _type_problem(o.key_or_group, default, o.value())):
            raise PlanError(problem)
    return _compose(config_dir, config_name, overrides)


#: A key whose value takes anything: absent (Hydra refuses it), ``???`` (mandatory) or an interpolation.
_UNTYPED = object()


def _default(cfg: Any, key: str) -> Any:
    """The default value at dotted ``key``, or _UNTYPED."""
    from omegaconf import DictConfig, ListConfig, OmegaConf

    parent_key, _, leaf = key.rpartition(".")
    parent = OmegaConf.select(cfg, parent_key, throw_on_resolution_failure=False) if parent_key else cfg
    if not isinstance(parent, DictConfig) or leaf not in parent:
        return _UNTYPED
    if OmegaConf.is_missing(parent, leaf) or OmegaConf.is_interpolation(parent, leaf):
        return _UNTYPED
    node = parent[leaf]
    if isinstance(node, DictConfig | ListConfig):
        return OmegaConf.to_container(node, resolve=False)
    return node
