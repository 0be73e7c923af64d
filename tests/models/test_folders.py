"""Every architecture lives in one folder under diffrl/models/, listed once in diffrl.models.ARCHITECTURES, and
nothing outside those folders defines a model builder or a real-size config."""

from __future__ import annotations

import ast
import os

from diffrl import models, registry

MODELS_DIR = os.path.dirname(os.path.abspath(models.__file__))
DIFFRL_DIR = os.path.dirname(MODELS_DIR)
# What diffrl/models/ holds beside the architecture folders: the parts every architecture shares.
SHARED = {
    "__init__.py",
    "base.py",
    "kind.py",
    "offload.py",
    "random_weights.py",
    "realsize.py",
    "tiny.py",
    "tokenizers.py",
    "wav.py",
}
NOT_ARCHITECTURES = {"reference", "__pycache__"}  # the shipped reference models: folders of weights, no code
# Keys of a model config (diffusers / transformers): a module-level dict with them is an architecture's config.
CONFIG_KEYS = {
    "num_attention_heads",
    "attention_head_dim",
    "num_hidden_layers",
    "num_layers",
    "hidden_size",
    "intermediate_size",
    "joint_attention_dim",
    "d_model",
}


def _python_files(root: str) -> list[str]:
    return [os.path.join(d, f) for d, _, files in os.walk(root) for f in files if f.endswith(".py")]


def test_every_folder_is_an_architecture_listed_once_and_only_shared_files_sit_beside_them():
    folders = {e for e in os.listdir(MODELS_DIR) if os.path.isdir(os.path.join(MODELS_DIR, e))} - NOT_ARCHITECTURES
    assert sorted(models.ARCHITECTURES) == sorted(f"diffrl.models.{f}" for f in folders)
    assert len(set(models.ARCHITECTURES)) == len(models.ARCHITECTURES)
    assert {e for e in os.listdir(MODELS_DIR) if e.endswith(".py")} == SHARED
    for folder in folders:  # an architecture folder is a package of modules, no deeper
        entries = set(os.listdir(os.path.join(MODELS_DIR, folder))) - {"__pycache__"}
        assert "__init__.py" in entries and all(e.endswith(".py") for e in entries), (folder, entries)


def test_every_adapter_tiny_builder_and_real_size_plan_is_registered_from_its_folder():
    for kind in ("model", "tiny", "realsize"):
        names = registry.names(kind)
        assert names, kind
        for name in names:
            module = registry.get(kind, name).obj.__module__
            assert module.rsplit(".", 1)[0] in models.ARCHITECTURES, f"{kind} {name!r} is registered by {module}"


def test_the_registry_imports_each_role_from_the_folders_alone():
    for kind, (role, _) in models.KINDS.items():
        for module in registry.builtin_modules(kind):
            package, stem = module.rsplit(".", 1)
            assert package in models.ARCHITECTURES and (stem == role or stem.startswith(role + "_")), module


def test_nothing_outside_the_architecture_folders_defines_a_model_config():
    """A real-size (or any) architecture config is a module-level dict of model-config keys; only the architecture
    folders hold one: not diffrl/engines/ (it holds no model builder), not the shared files of diffrl/models/."""
    offenders = []
    for path in _python_files(DIFFRL_DIR):
        rel = os.path.relpath(path, DIFFRL_DIR)
        parts = rel.split(os.sep)
        if parts[0] == "models" and len(parts) > 2 and f"diffrl.models.{parts[1]}" in models.ARCHITECTURES:
            continue
        assert "realsize" not in parts[-1] or rel == os.path.join("models", "realsize.py"), rel
        with open(path) as f:
            tree = ast.parse(f.read())
        for node in tree.body:
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None and _config_keys(node.value):
                offenders.append(f"{rel}:{node.lineno}")
    assert offenders == []


def _config_keys(value: ast.expr) -> set[str]:
    if isinstance(value, ast.Dict):
        keys = {k.value for k in value.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)}
    elif isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "dict":
        keys = {k.arg for k in value.keywords if k.arg}
    else:
        return set()
    return keys & CONFIG_KEYS
