"""Every engine front the server is handed has every member of `EngineClient`
(jaxserve/core/engine_client.py), with the protocol's parameters and its sync / async kind.

Read from the classes (their attributes, and the `self.<name> = ...` assignments of their
methods), so no engine is built: milliseconds.
"""
from __future__ import annotations

import ast
import inspect
import textwrap

import pytest

from jaxserve.async_engine import AsyncEngine
from jaxserve.core.engine_client import EngineClient

FRONTS = [AsyncEngine]  # the one async client: one engine core, data parallelism's replicas, a multi-host job


def protocol_members(protocol: type) -> dict[str, object]:
    return {name: value for name, value in vars(protocol).items()
            if not name.startswith("_") and (callable(value) or isinstance(value, property))}


def assigned_attributes(cls: type) -> set[str]:
    """Names a method of `cls` assigns as `self.<name> = ...` (tuple targets too)."""
    names = set()
    for node in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(cls)))):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, ast.AnnAssign) else []
        for target in targets:
            for leaf in target.elts if isinstance(target, ast.Tuple) else [target]:
                if isinstance(leaf, ast.Attribute) and isinstance(leaf.value, ast.Name) and leaf.value.id == "self":
                    names.add(leaf.attr)
    return names


def parameter_names(function) -> list[str]:
    return list(inspect.signature(function).parameters)[1:]  # without self


def test_the_protocol_declares_what_the_server_calls():
    assert set(protocol_members(EngineClient)) == {
        "tokenizer", "model_name", "max_model_len", "start", "shutdown", "is_alive", "health", "stats",
        "add_step_listener", "compile_structured_output", "generate", "lora_enabled", "lora_modules",
        "load_lora_adapter", "unload_lora_adapter", "pooling", "image_service"}
    assert all(inspect.getdoc(member) for member in protocol_members(EngineClient).values())


@pytest.mark.parametrize("front", FRONTS, ids=lambda cls: cls.__name__)
def test_front_has_every_member_of_the_protocol(front):
    assert "__getattr__" not in vars(front), "a front declares its members instead of forwarding unknown names"
    attributes = assigned_attributes(front)
    for name, member in protocol_members(EngineClient).items():
        if isinstance(member, property):
            assert name in attributes or isinstance(getattr(front, name, None), property), \
                f"{front.__name__} has no attribute {name!r}"
            continue
        method = getattr(front, name, None)
        assert callable(method), f"{front.__name__} has no method {name!r}"
        assert parameter_names(method) == parameter_names(member), f"{front.__name__}.{name}'s parameters"
        assert inspect.iscoroutinefunction(method) == inspect.iscoroutinefunction(member), \
            f"{front.__name__}.{name} is {'not ' if inspect.iscoroutinefunction(member) else ''}async"
