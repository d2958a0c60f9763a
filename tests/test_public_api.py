"""The public namespace never shrinks: every name exported before the renovation still imports
and is the same kind of object (class, exception, function, ...).

``public_api.json`` is the list of ``torchsupervisor``, ``torchsupervisor.summary`` and
``torchsupervisor.errors`` as landed before the layout changed (commit fdc9fce); names may be
added, none removed or changed in kind.
"""

from __future__ import annotations

import importlib
import inspect
import json
import os

import pytest

SNAPSHOT = os.path.join(os.path.dirname(__file__), "public_api.json")


def _kind(obj) -> str:
    if inspect.isclass(obj):
        return "exception" if issubclass(obj, BaseException) else "class"
    if inspect.isfunction(obj) or inspect.isbuiltin(obj):
        return "function"
    if inspect.ismodule(obj):
        return "module"
    if callable(obj):
        return "callable"
    return type(obj).__name__


with open(SNAPSHOT) as f:
    EXPORTED = json.load(f)


@pytest.mark.parametrize("module_name", sorted(EXPORTED))
def test_every_name_exported_before_still_imports_as_the_same_kind(module_name):
    module = importlib.import_module(module_name)
    missing = sorted(set(EXPORTED[module_name]) - set(module.__all__))
    assert not missing, f"{module_name} no longer exports {missing}"
    changed = {
        name: (kind, _kind(getattr(module, name)))
        for name, kind in EXPORTED[module_name].items()
        if _kind(getattr(module, name)) != kind
    }
    assert not changed, f"{module_name}: (was, is) {changed}"


def test_the_errors_are_real_classes_in_errors_py():
    from torchsupervisor import errors

    for name in EXPORTED["torchsupervisor.errors"]:
        obj = getattr(errors, name)
        if inspect.isclass(obj):
            assert obj.__module__ == "torchsupervisor.errors", name
            # A class built with type() has no class statement: getsource cannot find one.
            assert inspect.getsource(obj).startswith(f"class {name}("), name
