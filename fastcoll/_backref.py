"""Back-references that do not keep their target alive: fastcoll's objects are freed by reference counting alone.

A part that points back at its owner (the reducer's kept gradients at the
reducer, a DDP's join state at the DDP, a hook at the object it serves) would
otherwise close a reference cycle, and the whole owner (its buckets, its
gradients) would live on until the cyclic garbage collector runs, as torch's
own optimizers and modules never do. :class:`BackRef` stores such an
attribute as a ``weakref.ref``; :func:`weak_method` turns a bound method
into a callable that holds its object weakly.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Optional

__all__ = ["BackRef", "weak_method"]


def _gone(what: str, owner: str) -> ReferenceError:
    return ReferenceError(f"fastcoll: the {what} this {owner} belongs to was deleted; it can no longer be used")


class BackRef:
    """A data descriptor: ``obj.name = target`` keeps only a weak reference; reading it returns the target.

    Reading it after the target was freed raises ``ReferenceError`` (the part outlived its owner, which a
    caller reaches only by keeping the part alone).
    """

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name
        self.slot = f"_{name}_ref"

    def __get__(self, obj: Any, objtype: Optional[type] = None) -> Any:
        if obj is None:
            return self
        ref = obj.__dict__.get(self.slot)
        if ref is None:
            raise AttributeError(f"'{type(obj).__name__}' object has no attribute '{self.name}'")
        target = ref()
        if target is None:
            raise _gone(self.name, type(obj).__name__)
        return target

    def __set__(self, obj: Any, value: Any) -> None:
        obj.__dict__[self.slot] = weakref.ref(value)


def weak_method(method: Callable[..., Any], gone: Optional[str] = None) -> Callable[..., Any]:
    """``method`` (a bound method) as a plain function holding its object weakly.

    Args:
        method: A bound method.
        gone: The message of the error raised when the method's object was freed (default: a generic one).

    Raises:
        ReferenceError: when called after the method's object was freed.
    """
    ref = weakref.WeakMethod(method)  # type: ignore[arg-type]
    owner = type(method.__self__).__name__  # type: ignore[attr-defined]
    name = method.__name__

    def call(*args: Any, **kwargs: Any) -> Any:
        bound = ref()
        if bound is None:
            raise ReferenceError(gone) if gone else _gone(owner, f"{name} callback")
        return bound(*args, **kwargs)

    call.__name__ = call.__qualname__ = name
    return call
