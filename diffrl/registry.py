"""The one registry of diffrl: where a name from a config or the command line becomes an object.

Every kind of plug-in uses it the same way: a decorator in the plug-in's own file registers it, and the kind's home
module declares which built-in modules to import on the first lookup (importing them costs seconds: diffusers
pipelines, OCR models), so `import diffrl...` stays cheap. The model kinds (model, tiny, realsize) are declared in
diffrl/models/__init__.py from its one list of architecture folders.

    kind        registered object                                   decorator (home module)
    model       ModelAdapter subclass, by arch ("sd3", "flux", ...)   models.base.register_adapter
    tiny        fn(out_dir, seed) writing a tiny pipeline             models.tiny.register_tiny
    realsize    fn(scale) -> Plan of a real-size pipeline folder      models.realsize.register_plan
    reward      factory(options) -> RewardFunction, with `options`     engines.reward.base.register_reward
    algorithm   Algorithm (catalog bundle)                          algorithms.catalog

A task kit (diffrl/shapes) registers plug-ins of a kind whose home is in a lower layer (its rewards use
engines.reward.base.register_reward). Its modules are listed here, in KIT_MODULES, and imported on the kind's first
lookup after the home's built-ins: config names such as `geneval_lite` work wherever a name becomes an object, while
the layers below the kit never import it.

An unknown name is a ValueError naming the kind, the choices and the closest match.
"""

from __future__ import annotations

import difflib
import importlib
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable


@dataclass(frozen=True)
class Entry:
    """One registered plug-in: `obj` (a class or factory) and what its kind records beside it (`meta`)."""

    kind: str
    name: str
    obj: Any
    meta: dict = field(default_factory=dict)


# kind -> the task kits' modules that register plug-ins of it (imported on the kind's first lookup, after its built-ins)
KIT_MODULES: dict[str, tuple[str, ...]] = {
    "reward": ("diffrl.shapes.geneval_lite", "diffrl.shapes.edit_reward"),
}

_ENTRIES: dict[str, dict[str, Entry]] = {}
_BUILTINS: dict[str, tuple[str, ...]] = {}
_LABELS: dict[str, str] = {}
_LOADED: set[str] = set()
_LOCK = threading.RLock()


def declare(kind: str, builtin_modules: Iterable[str], label: str | None = None) -> None:
    """Name the modules that register the built-in plug-ins of `kind` (imported on its first lookup) and what
    its errors call it ("model architecture"). Declaring a kind again replaces its list: the next lookup imports
    the modules not imported yet."""
    with _LOCK:
        _BUILTINS[kind] = tuple(builtin_modules)
        _LABELS[kind] = label or kind
        _ENTRIES.setdefault(kind, {})
        _LOADED.discard(kind)


def builtin_modules(kind: str) -> tuple[str, ...]:
    """The modules imported on the first lookup of `kind`: its home's built-ins, then the task kits' modules."""
    return _BUILTINS.get(kind, ()) + KIT_MODULES.get(kind, ())


def register(kind: str, name: str, **meta: Any) -> Callable[[Any], Any]:
    """Decorator: register `obj` as `name` of `kind` (registering another object under a taken name is an error)."""

    def decorator(obj: Any) -> Any:
        with _LOCK:
            entries = _ENTRIES.setdefault(kind, {})
            taken = entries.get(name)
            if taken is not None and taken.obj is not obj and not _same_definition(taken.obj, obj):
                raise ValueError(f"{_LABELS.get(kind, kind)} {name!r} is already registered by {_where(taken.obj)}")
            entries[name] = Entry(kind=kind, name=name, obj=obj, meta=dict(meta))
        return obj

    return decorator


def unregister(kind: str, name: str) -> None:
    """Remove `name` of `kind` (a plug-in a test registered)."""
    with _LOCK:
        _ENTRIES.get(kind, {}).pop(name, None)


def load_builtins(kind: str) -> None:
    """Import every built-in module of `kind` (once)."""
    if kind in _LOADED:
        return
    imported: set[str] = set()
    # a kit's module imports the kind's home, which may declare its built-ins only then: import until none is left
    while pending := [m for m in builtin_modules(kind) if m not in imported]:
        for module in pending:
            importlib.import_module(module)
            imported.add(module)
    _LOADED.add(kind)


def get(kind: str, name: str) -> Entry:
    """The entry `name` of `kind`; ValueError with the choices (and the closest one) when unknown."""
    load_builtins(kind)
    entries = _ENTRIES.get(kind, {})
    if name not in entries:
        choices = sorted(entries)
        close = difflib.get_close_matches(str(name), choices, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"unknown {_LABELS.get(kind, kind)} {name!r}{hint}; choose one of {choices}")
    return entries[name]


def names(kind: str) -> list[str]:
    """Sorted names of `kind`, built-ins included."""
    load_builtins(kind)
    return sorted(_ENTRIES.get(kind, {}))


def registered(kind: str) -> dict[str, Entry]:
    """What is registered under `kind` now, without importing the built-ins (callers that import lazily)."""
    return dict(_ENTRIES.get(kind, {}))


def _same_definition(a: Any, b: Any) -> bool:
    """The same class or function defined twice (a module reloaded): not a clash. Instances never are."""
    return hasattr(a, "__qualname__") and hasattr(b, "__qualname__") and _where(a) == _where(b)


def _where(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', repr(obj))}"
