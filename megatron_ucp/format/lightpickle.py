"""Read DeepSpeed checkpoint files without importing DeepSpeed, and write such objects back faithfully.

DeepSpeed's rank files pickle a few DeepSpeed objects (``fragment_address`` in
``param_slice_mappings``, ``ZeroStageEnum``, ``LossScaler``). Unpickling them with the stock
unpickler imports the ``deepspeed`` package: ~2 s of CPU on a small machine, most of a
conversion's fixed cost, and more on a shared file system. :data:`PICKLE_MODULE` is a
``pickle_module`` for ``torch.load``/``torch.save``:

* loading: classes of ``deepspeed.*`` and ``megatron.*`` resolve to stand-in classes
  (:class:`StandIn`) while that package is not imported; once it is (e.g. inside a training process), the real
  classes are used and nothing changes. A stand-in keeps exactly how the object was built (the
  constructor arguments and the pickled state), exposes dict state as attributes (``.start``,
  ``.numel``), and behaves as an int where it wraps one (``int(ZeroStageEnum(1)) == 1``).
* saving: stand-ins are written back as the same global reference with the same arguments and
  state, so ``torch.load`` with DeepSpeed importable rebuilds the real objects. The standard
  (C) pickler cannot do that; :func:`needs_light_pickler` tells when to pass this module to
  ``torch.save`` (any stand-in created in this process), and a stand-in given to the standard
  pickler fails loudly rather than writing something else.
"""

from __future__ import annotations

import contextlib
import contextvars
import copyreg
import pickle
import sys
import threading
from typing import Any, Iterator

__all__ = ["PICKLE_MODULE", "StandIn", "needs_light_pickler", "is_stand_in", "stand_ins_for_unimportable"]

_LOCK = threading.Lock()
_CLASSES: dict[tuple[str, str], type] = {}
_LIGHT_PREFIXES = ("deepspeed", "megatron")
"""Packages whose classes load as stand-ins until the process imports them. ``megatron`` too:
importing it before a Megatron-DeepSpeed script runs would bind whichever ``megatron`` comes first
on ``sys.path`` (the registry's megatron-core namespace shadows the checkout's own package)."""


def _light(module: str) -> bool:
    root = module.split(".", 1)[0]
    return root in _LIGHT_PREFIXES and root not in sys.modules


class StandIn:
    """An instance of a class that was not imported; see the module docstring."""

    _ucp_module = ""
    _ucp_name = ""

    def __new__(cls, *args: Any, **kwargs: Any) -> "StandIn":
        obj = object.__new__(cls)
        object.__setattr__(obj, "_ucp_how", "newobj_ex" if kwargs else "newobj")
        object.__setattr__(obj, "_ucp_args", args)
        object.__setattr__(obj, "_ucp_kwargs", kwargs)
        return obj

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # Only an unpickler's REDUCE calls the class; NEWOBJ calls __new__ alone.
        object.__setattr__(self, "_ucp_how", "call")

    def __setstate__(self, state: Any) -> None:
        object.__setattr__(self, "_ucp_state", state)
        if isinstance(state, tuple) and len(state) == 2 and (state[0] is None or isinstance(state[0], dict)):
            dict_state, slot_state = state
            self.__dict__.update(dict_state or {})
            self.__dict__.update(slot_state or {})
        elif isinstance(state, dict):
            self.__dict__.update(state)

    # --- faithful re-pickling -----------------------------------------------------------------
    def __reduce_ex__(self, protocol: int) -> tuple:
        cls = type(self)
        how = self.__dict__.get("_ucp_how", "reconstructor")
        args = self.__dict__.get("_ucp_args", ())
        state = self.__dict__.get("_ucp_state", None)
        if how == "call":
            out: tuple = (cls, args)
        elif how == "newobj":
            out = (copyreg.__newobj__, (cls, *args))
        elif how == "newobj_ex":
            out = (copyreg.__newobj_ex__, (cls, args, self.__dict__.get("_ucp_kwargs", {})))
        else:
            out = (copyreg._reconstructor, (cls, object, None))
        return out + (state,) if "_ucp_state" in self.__dict__ else out

    # --- behave like the original where the converter needs it ----------------------------------
    def _ucp_int(self) -> int:
        args = self.__dict__.get("_ucp_args", ())
        if len(args) == 1 and isinstance(args[0], int):
            return int(args[0])
        raise TypeError(f"{self!r} is not an integer")

    def __int__(self) -> int:
        return self._ucp_int()

    def __index__(self) -> int:
        return self._ucp_int()

    def _ucp_key(self) -> tuple:
        return (
            self._ucp_module,
            self._ucp_name,
            self.__dict__.get("_ucp_how"),
            repr(self.__dict__.get("_ucp_args", ())),
            repr(self.__dict__.get("_ucp_state")),
        )

    def __eq__(self, other: Any) -> bool:
        if isinstance(other, StandIn):
            return self._ucp_key() == other._ucp_key()
        if isinstance(other, int) and not isinstance(other, bool):
            try:
                return self._ucp_int() == other
            except TypeError:
                return False
        return NotImplemented

    def __hash__(self) -> int:
        try:
            return hash(self._ucp_int())
        except TypeError:
            return hash(self._ucp_key())

    def __repr__(self) -> str:
        state = self.__dict__.get("_ucp_state")
        shown = self.__dict__.get("_ucp_args") or state
        return f"<{self._ucp_module}.{self._ucp_name} (DeepSpeed not imported) {shown!r}>"


def stand_in_class(module: str, name: str) -> type:
    key = (module, name)
    with _LOCK:
        cls = _CLASSES.get(key)
        if cls is None:
            cls = type(
                name, (StandIn,), {"_ucp_module": module, "_ucp_name": name, "__module__": module, "__qualname__": name}
            )
            _CLASSES[key] = cls
    return cls


def is_stand_in(obj: Any) -> bool:
    return isinstance(obj, StandIn) or (isinstance(obj, type) and issubclass(obj, StandIn))


def needs_light_pickler() -> bool:
    """True once any stand-in class exists in this process (objects loaded may contain them)."""
    return bool(_CLASSES)


_TOLERANT: contextvars.ContextVar[bool] = contextvars.ContextVar("megatron_ucp_tolerant_unpickling", default=False)


@contextlib.contextmanager
def stand_ins_for_unimportable() -> Iterator[None]:
    """Within: a class that cannot be imported loads as a stand-in instead of failing.

    For readers that only want plain values out of a file whose pickled objects belong to code
    that is not importable here (the runner reading Megatron's ``args`` before the script runs).
    The converter does not use it: there an unknown class is an error.
    """
    token = _TOLERANT.set(True)
    try:
        yield
    finally:
        _TOLERANT.reset(token)


class Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if _light(module):
            return stand_in_class(module, name)
        try:
            return super().find_class(module, name)
        except (ImportError, AttributeError):
            if _TOLERANT.get():
                return stand_in_class(module, name)
            raise


class Pickler(pickle._Pickler):  # the Python pickler: its save_global can be taught about stand-ins
    def save_global(self, obj: Any, name: Any = None) -> None:
        if isinstance(obj, type) and issubclass(obj, StandIn) and obj is not StandIn:
            if self.proto >= 4:
                self.save(obj._ucp_module)
                self.save(obj._ucp_name)
                self.write(pickle.STACK_GLOBAL)
            else:
                self.write(
                    pickle.GLOBAL + obj._ucp_module.encode("utf-8") + b"\n" + obj._ucp_name.encode("utf-8") + b"\n"
                )
            self.memoize(obj)
            return
        super().save_global(obj, name)


class _PickleModule:
    """What ``torch.load(pickle_module=...)`` / ``torch.save(pickle_module=...)`` use."""

    __name__ = "megatron_ucp.format.lightpickle"
    Unpickler = Unpickler
    Pickler = Pickler
    load = staticmethod(lambda f, **kw: Unpickler(f, **kw).load())
    HIGHEST_PROTOCOL = pickle.HIGHEST_PROTOCOL
    DEFAULT_PROTOCOL = pickle.DEFAULT_PROTOCOL


PICKLE_MODULE = _PickleModule()
