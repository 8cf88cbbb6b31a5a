"""Reference twins take their entry point's signature: parameters and defaults stated once.

Every entry point ``mm3lab.<step>.<name>`` has a pure-PyTorch twin of the same name in
``mm3lab.<step>.reference`` (collected in :mod:`mm3lab.reference`). The twin's body
names the arguments it reads, in the entry point's order (or takes ``**arguments``);
:func:`twin_of` binds each call to the entry point's signature (its defaults,
keyword-only markers and annotations) and hands the body every argument by name. So
the two cannot drift apart, and ``help`` and :func:`inspect.signature` show the entry
point's signature, less what the reference has no use for (``algorithm``: which
kernel runs).

An entry point's package imports its reference before it defines the entry point, so
a twin made then takes its signature when ``import mm3lab`` completes
(:func:`bind_signatures`), or on its first call, whichever comes first.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import sys

_UNBOUND: list = []  # twins made before their entry point existed


def _entry_signature(twin) -> inspect.Signature:
    entry = getattr(importlib.import_module(twin.entry_module), twin.__name__)
    taken = inspect.signature(twin.__wrapped__).parameters
    signature = inspect.signature(entry)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in taken.values()):
        return signature  # the body takes every argument
    kept = [p for name, p in signature.parameters.items() if name in taken]
    if [p.name for p in kept] != list(taken):
        raise TypeError(
            f"{twin.__module__}.{twin.__name__} takes {list(taken)}: not parameters of "
            f"{twin.entry_module}.{twin.__name__} in its order"
        )
    return signature.replace(parameters=kept)


def _signature(twin) -> inspect.Signature:
    signature = twin.__dict__.get("__signature__")
    if signature is None:
        signature = twin.__signature__ = _entry_signature(twin)
    return signature


def twin_of(module: str):
    """Decorator: the function is the reference twin of the entry point of the same name in ``module``."""

    def decorate(body):
        @functools.wraps(body)
        def twin(*args, **kwargs):
            bound = _signature(twin).bind(*args, **kwargs)
            bound.apply_defaults()
            return body(**bound.arguments)

        twin.entry_module = module
        if hasattr(sys.modules.get(module), body.__name__):
            _signature(twin)
        else:
            _UNBOUND.append(twin)
        return twin

    return decorate


def bind_signatures() -> None:
    """Give every twin made so far its entry point's signature (``import mm3lab`` calls this last)."""
    while _UNBOUND:
        _signature(_UNBOUND.pop())
