"""Extract the config that Megatron-Bridge's ``run_recipe.py`` overrides, for the megatron-bridge profile.

Megatron-Bridge needs Python 3.12 and GPU-only packages, so retrain cannot import it; instead this
script, run once per pinned release in a throwaway Python 3.12 environment, writes what the profile
checks its overrides against (``retrain/resources/megatron-bridge-<release>/config.json``):

- ``config``: the OmegaConf tree of the recipe as ``run_recipe.py --recipe R --mode pretrain --dataset
  megatron-indexed`` builds it before applying the command line's overrides (the recipe, then
  ``recipe.dataset = build_dataset_config(recipe, "megatron-indexed")``; scripts/training/run_recipe.py
  ``main`` and ``_apply_dataset``), made by Bridge's own ``create_omegaconf_dict_config``: the keys
  ``parse_hydra_overrides`` accepts without ``+``;
- ``types``: each leaf's annotated type, as the JSON kinds a value may have (and a ``Literal``'s
  choices), read from the config dataclasses (Bridge does not check types; retrain does).

Usage (the packages' own dependencies are heavy; ``--no-deps`` and the few imports the config modules
need are enough, the GPU-only ones stubbed below)::

    python3.12 -m venv /tmp/mb && /tmp/mb/bin/pip install torch==2.13.0
    /tmp/mb/bin/pip install --no-deps megatron-bridge==0.6.2 megatron-core==0.19.2
    /tmp/mb/bin/pip install omegaconf hydra-core einops "transformers==5.12.1" datasets accelerate \
        peft megatron-energon matplotlib IPython diffusers tensorboard
    /tmp/mb/bin/python scripts/extract_bridge_config.py retrain/resources/megatron-bridge-0.6.2/config.json
"""

from __future__ import annotations

import dataclasses
import enum
import importlib.abc
import importlib.machinery
import json
import os
import pathlib
import sys
import types
import typing
from typing import Any
from unittest import mock

RECIPE = "vanilla_gpt_pretrain_config"
DATASET = "megatron-indexed"
#: Where the NeMo Framework container keeps the checkout; run_recipe.py chdirs there and the recipes
#: build their default paths from the working directory.
REPO_ROOT = "/opt/Megatron-Bridge"
#: Imported by the config modules' packages, used only on a GPU.
STUBBED = {"transformer_engine", "wandb", "flashinfer", "mlflow", "comet_ml", "fla", "timm", "open_clip"}
STUBBED |= {"qwen_vl_utils", "fast_hadamard_transform", "mistral_common", "modelopt"}


class _Stubs(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name.split(".")[0] in STUBBED:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
        module = mock.MagicMock(name=spec.name)
        module.__path__, module.__spec__, module.__name__, module.__version__ = [], spec, spec.name, "2.9.0"
        return module

    def exec_module(self, module: Any) -> None:
        return None


def kinds(annotation: Any) -> tuple[set[str], list[Any] | None]:
    """The JSON kinds a value of ``annotation`` may have, and a Literal's choices."""
    origin = typing.get_origin(annotation)
    if annotation is type(None) or annotation is None:
        return {"null"}, None
    if origin in (typing.Union, types.UnionType):
        out: set[str] = set()
        choices: list[Any] | None = []
        for arg in typing.get_args(annotation):
            k, c = kinds(arg)
            out |= k
            if c is None and arg is not type(None):
                choices = None
            elif choices is not None and c is not None:
                choices += c
        return out, choices or None
    if origin is typing.Literal:
        values = list(typing.get_args(annotation))
        return {_kind(v) for v in values}, values
    if origin in (list, tuple, typing.List, typing.Tuple) or annotation in (list, tuple):  # noqa: UP006
        return {"list"}, None
    if origin is dict or annotation is dict:
        return {"dict"}, None
    if annotation is bool:
        return {"bool"}, None
    if annotation is int:
        return {"int"}, None
    if annotation is float:
        return {"float", "int"}, None
    if annotation in (str, pathlib.Path) or (
        isinstance(annotation, type) and issubclass(annotation, enum.Enum)
    ):
        return {"str"}, None
    return {"any"}, None


def _kind(value: Any) -> str:
    return {bool: "bool", int: "int", float: "float", str: "str", type(None): "null"}.get(type(value), "any")


def leaf_types(obj: Any, prefix: str, out: dict[str, Any]) -> None:
    hints = typing.get_type_hints(type(obj), include_extras=False)
    for f in dataclasses.fields(obj):
        path = f"{prefix}{f.name}"
        value = getattr(obj, f.name, None)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            leaf_types(value, path + ".", out)
            continue
        annotation = hints.get(f.name, typing.Any)
        k, choices = kinds(annotation)
        entry: dict[str, Any] = {"kinds": sorted(k)}
        if choices is not None:
            entry["choices"] = choices
        out[path] = entry


def main() -> int:
    sys.meta_path.insert(0, _Stubs())
    os.getcwd = lambda: REPO_ROOT  # type: ignore[assignment]  # the container's working directory
    from megatron.bridge import recipes
    from megatron.bridge.package_info import __version__
    from megatron.bridge.recipes.utils.dataset_utils import build_dataset_config
    from megatron.bridge.training.utils.omegaconf_utils import create_omegaconf_dict_config
    from omegaconf import OmegaConf

    recipe = getattr(recipes, RECIPE)()
    recipe.dataset = build_dataset_config(recipe, DATASET)
    tree, _ = create_omegaconf_dict_config(recipe)
    typed: dict[str, Any] = {}
    leaf_types(recipe, "", typed)
    body = {
        "release": __version__,
        "recipe": RECIPE,
        "dataset": DATASET,
        "source": "megatron-bridge (PyPI) scripts/extract_bridge_config.py",
        "config": OmegaConf.to_container(tree),
        "types": typed,
    }
    # the packages print while importing: the result goes to its own file
    pathlib.Path(sys.argv[1]).write_text(json.dumps(body, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
