"""torchvision's catalogue of datasets and models, read from its source files: a bad name is
refused before torch is imported (about 2 s)."""

from __future__ import annotations

import ast
import importlib.util
from functools import cache
from pathlib import Path


@cache
def torchvision_dataset_names() -> frozenset[str]:
    """torchvision.datasets.__all__, read from torchvision's source (no import of torch)."""
    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("torchvision is not installed; run `make install`")
    tree = ast.parse((Path(spec.submodule_search_locations[0]) / "datasets" / "__init__.py")
                     .read_text(encoding="utf-8"))
    for node in tree.body:
        if (isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__"
                                                 for t in node.targets)):
            return frozenset(ast.literal_eval(node.value))
    return frozenset()


@cache
def torchvision_model_names() -> frozenset[str]:
    """torchvision.models.list_models(module=torchvision.models), read from torchvision's source.

    Importing torchvision imports torch (about 2 s), and a bad value must be refused before that;
    the registry is the `@register_model()` decorators of the classification modules.
    """
    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("torchvision is not installed; run `make install`")
    names = set()
    for module in sorted((Path(spec.submodule_search_locations[0]) / "models").glob("*.py")):
        for node in ast.walk(ast.parse(module.read_text(encoding="utf-8"))):
            if isinstance(node, ast.FunctionDef):
                names.update(_registered_name(node))
    return frozenset(names)


def _registered_name(function: ast.FunctionDef) -> list[str]:
    for decorator in function.decorator_list:
        if (isinstance(decorator, ast.Call) and isinstance(decorator.func, ast.Name)
                and decorator.func.id == "register_model"):
            named = [k.value for k in decorator.keywords if k.arg == "name"]
            if named and isinstance(named[0], ast.Constant):
                return [named[0].value]
            if decorator.args and isinstance(decorator.args[0], ast.Constant):
                return [decorator.args[0].value]
            return [function.name]
    return []
