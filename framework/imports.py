"""Import user-named classes from dotted paths (`class_path` / `init_args`) with importlib; no eval."""

from __future__ import annotations

import contextlib
import difflib
import importlib
import inspect
import json
import os
import pkgutil
import sys
import sysconfig
import traceback
import types
import typing
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from framework.errors import FwError, what_raised


def _is_prefix(name: str | None, dotted: str) -> bool:
    return name is not None and (dotted == name or dotted.startswith(name + "."))


def _raised_at(e: BaseException) -> str:
    """` (at FILE:LINE)`: the line of a module body that raised `e` while it was imported (the innermost, when one
    user module imports another), or the line a SyntaxError names; "" when there is none."""
    if isinstance(e, SyntaxError) and e.filename and e.lineno:
        return f" (at {e.filename}:{e.lineno})"
    bodies = [f for f in traceback.extract_tb(e.__traceback__) if f.name == "<module>"]
    return f" (at {bodies[-1].filename}:{bodies[-1].lineno})" if bodies else ""


def _submodules(package: Any) -> list[str]:
    """The names of a package's modules and subpackages (none for a module that is not a package)."""
    return [m.name for m in pkgutil.iter_modules(getattr(package, "__path__", None) or [])]


def _dirs(*names: str) -> tuple[str, ...]:
    """sysconfig's directories of these names, resolved, each ending in a separator (for prefix tests)."""
    return tuple({os.path.join(os.path.realpath(path), "") for name in names
                  if (path := sysconfig.get_paths().get(name))})


STDLIB_DIRS = _dirs("stdlib", "platstdlib")   # Python's own modules
SITE_DIRS = _dirs("purelib", "platlib")   # installed packages (inside the stdlib directory on some layouts)


def in_library(file: str) -> bool:
    """Whether source file `file` belongs to Python's own modules or an installed package, not to user code."""
    return os.path.realpath(file).startswith(STDLIB_DIRS + SITE_DIRS)


# fw's packages, wherever installed (a source checkout's recipes/ and ops_cuda/ sit beside framework/, outside
# site-packages)
_ROOT = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
FW_PACKAGES = tuple(os.path.join(_ROOT, name, "") for name in ("framework", "recipes", "ops_cuda"))


def is_fw_file(file: str) -> bool:
    """Whether source file `file` is one of fw's packages'."""
    return os.path.realpath(file).startswith(FW_PACKAGES)


def is_user_file(file: str, ours: Callable[[str], bool] = is_fw_file) -> bool:
    """Whether source file `file` is the user's: neither `ours` (fw's) nor Python's or an installed package's."""
    return not file.startswith("<") and not in_library(file) and not ours(file)


def user_frame(frames: list[traceback.FrameSummary], ours: Callable[[str], bool]) -> traceback.FrameSummary | None:
    """The innermost of `frames` (outermost first) in the user's code (`is_user_file`: the line of a user's code
    that called json, not json's); None when there is none."""
    return next((frame for frame in reversed(frames) if is_user_file(frame.filename, ours)), None)


def user_line(e: BaseException) -> str:
    """` (at FILE:LINE)`: the innermost line of `e`'s traceback in the user's code, not fw's, Python's or an
    installed package's; "" when there is none."""
    frame = user_frame(traceback.extract_tb(e.__traceback__), is_fw_file)
    return f" (at {frame.filename}:{frame.lineno})" if frame else ""


def _in_stdlib(module: Any) -> bool:
    """Whether `module` is one of Python's standard library (a user's file of its name is shadowed by it)."""
    file = getattr(module, "__file__", None)
    if module.__name__.split(".")[0] in sys.builtin_module_names:
        return True
    if not file:
        return False
    path = os.path.realpath(file)
    return path.startswith(STDLIB_DIRS) and not path.startswith(SITE_DIRS)


def _shadowed(module: Any) -> str | None:
    """A file of the user's of the top-level `module`'s name in a directory that class_path modules are imported from
    (`add_search_paths`, which come after everything else on sys.path), which `module` was imported instead of."""
    file = getattr(module, "__file__", None)
    if not file:
        return None
    for directory in SEARCH_PATHS:
        for mine in (os.path.join(directory, f"{module.__name__}.py"),
                     os.path.join(directory, module.__name__, "__init__.py")):
            if os.path.isfile(mine) and os.path.realpath(mine) != os.path.realpath(file):
                return mine
    return None


_MODULE = "'{0}' is a module; class_path names a class in it, such as '{0}.ClassName'"


def import_object(class_path: str) -> Any:
    """Return the object at `pkg.module.Name` (nested attributes allowed: `pkg.mod.Outer.Inner`).

    Raises FwError saying whether a module or an attribute is missing.
    """
    parts = class_path.split(".")
    if len(parts) < 2 or not all(p.isidentifier() for p in parts):
        raise FwError(f"'{class_path}' is not a dotted path like 'package.module.ClassName'")
    missing_module = None
    for i in range(len(parts) - 1, 0, -1):  # longest importable module prefix, then attributes
        module_name = ".".join(parts[:i])
        try:
            obj = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            if not _is_prefix(e.name, module_name):  # the module exists but imports something missing
                raise FwError(f"cannot import '{class_path}': importing module '{module_name}' failed: {e}"
                              f"{_raised_at(e)}") from e
            missing_module = missing_module or e.name
            continue
        except Exception as e:  # the user's module itself is broken (SyntaxError, error at import time, ...)
            text = e.msg if isinstance(e, SyntaxError) and e.filename else e   # the file is named below
            raise FwError(f"cannot import '{class_path}': importing module '{module_name}' failed: "
                          f"{type(e).__name__}: {text}{_raised_at(e)}") from e
        except SystemExit as e:  # sys.exit() at import would end fw with the module's exit code
            raise FwError(f"cannot import '{class_path}': module '{module_name}' called sys.exit({e.code!r}) "
                          "while being imported") from e
        owner = module_name
        for attr in parts[i:]:
            if not hasattr(obj, attr) and owner == module_name and missing_module:
                # `pkg.nosuchmod.Cls`: the missing piece is the module, not an attribute of `pkg`
                hint = ""
                if missing_module == f"{module_name}.{attr}":
                    close = difflib.get_close_matches(attr, _submodules(obj), n=1)
                    hint = f"; did you mean '{'.'.join([*parts[:i], close[0], *parts[i + 1:]])}'?" if close else ""
                raise FwError(f"cannot import '{class_path}': no module named '{missing_module}'{hint}")
            if not hasattr(obj, attr) and owner == module_name and attr == parts[-1] and attr in _submodules(obj):
                raise FwError(_MODULE.format(class_path))   # a module not imported yet is no attribute of its package
            if not hasattr(obj, attr):
                close = difflib.get_close_matches(attr, [n for n in dir(obj) if not n.startswith("_")], n=1)
                hint = f"; did you mean '{owner}.{close[0]}'?" if close else ""
                if not close and owner == module_name and "." not in module_name and _in_stdlib(obj):
                    where = getattr(obj, "__file__", None) or "built into the interpreter"
                    hint = (f"; '{module_name}' is Python's own module ({where}), which a file of yours of "
                            "that name does not replace: rename your file")
                elif not close and owner == module_name and "." not in module_name and (mine := _shadowed(obj)):
                    what = "fw's own package" if is_fw_file(obj.__file__) else \
                        "an installed package" if in_library(obj.__file__) else "another module"
                    hint = (f"; '{module_name}' is {what} ({obj.__file__}), which your {mine} of that name does not "
                            "replace: rename your file")
                raise FwError(f"cannot import '{class_path}': module '{module_name}' has no attribute "
                              f"'{attr}'{hint}" if owner == module_name else
                              f"cannot import '{class_path}': '{owner}' has no attribute '{attr}'{hint}")
            obj = getattr(obj, attr)
            owner = f"{owner}.{attr}"
        if isinstance(obj, types.ModuleType):
            raise FwError(_MODULE.format(class_path))
        return obj
    raise FwError(f"cannot import '{class_path}': no module named '{missing_module}'")


# Every directory `add_search_paths` was given in this process, in order: a resolved config.yaml records them, so
# that `fw eval` / `fw generate` of a checkpoint import the run's class_path modules from any working directory.
SEARCH_PATHS: list[str] = []


def add_search_paths(directories: list[str]) -> None:
    """Make modules in `directories` importable by `class_path`, after everything already on sys.path.

    The `fw` console script, unlike `python -m framework`, does not put the working directory on sys.path;
    a user's module next to the config or in the working directory must import either way. Appending
    keeps a file there from shadowing an installed module of the same name.
    """
    for d in directories:
        d = os.path.abspath(d)
        if d not in SEARCH_PATHS:
            SEARCH_PATHS.append(d)
        if d not in (os.path.abspath(p or os.curdir) for p in sys.path):
            sys.path.append(d)


def import_class(class_path: str) -> type:
    """Return the class at `class_path`; FwError if it cannot be imported or is not a class."""
    obj = import_object(class_path)
    if not isinstance(obj, type):
        raise FwError(f"'{class_path}' is a {type(obj).__name__}, not a class")
    return obj


class InitArgsError(FwError):
    """init_args that a class does not take; `keys`: the ones it refuses, for the config to show the problem where
    they were set (a command-line override of one key, not the file's whole init_args)."""

    def __init__(self, message: str, keys: Iterable[Any]):
        super().__init__(message)
        self.keys = tuple(keys)


def _refuses(sig: inspect.Signature, key: Any, value: Any) -> bool:
    try:
        sig.bind_partial(**{key: value})
    except TypeError:
        return True
    return False


_SCALARS = (int, float, str, bool, type(None))


def _unannotated(t: Any) -> Any:
    """`t` without `typing.Annotated`'s metadata; `None` written as an annotation is NoneType."""
    while typing.get_origin(t) is typing.Annotated:
        t = typing.get_args(t)[0]
    return type(None) if t is None else t


def _checkable(t: Any) -> bool:
    """Whether annotation `t` is one whose values YAML data can be checked against exactly: int, float, str, bool,
    None, bare list / dict, `list[X]`, `dict[str, X]` and unions of these. Any, classes, protocols, callables,
    tuples, literals, forward references are the constructor's to judge."""
    t = _unannotated(t)
    if t in _SCALARS or t in (list, dict):
        return True
    origin, args = typing.get_origin(t), typing.get_args(t)
    if origin in (typing.Union, types.UnionType):
        return all(_checkable(a) for a in args)
    if origin is list:
        return len(args) == 1 and _checkable(args[0])
    if origin is dict:
        return len(args) == 2 and _unannotated(args[0]) is str and _checkable(args[1])
    return False


def _type_text(t: Any) -> str:
    """Annotation `t` as written in Python 3.10+: `int | None`, `list[str]`, `dict[str, float]`."""
    t = _unannotated(t)
    if t is type(None):
        return "None"
    origin, args = typing.get_origin(t), typing.get_args(t)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_text(a) for a in args)
    if origin in (list, dict):
        return f"{origin.__name__}[{', '.join(_type_text(a) for a in args)}]"
    return t.__name__


def _shape_fits(value: Any, t: Any) -> bool:
    """Whether `value` is of `t`'s outer type (its items unchecked): bool is no int here, an int is a float."""
    t = _unannotated(t)
    origin = typing.get_origin(t)
    if origin in (typing.Union, types.UnionType):
        return any(_shape_fits(value, a) for a in typing.get_args(t))
    if isinstance(value, bool):
        return t is bool
    if t is float:
        return isinstance(value, (int, float))
    return isinstance(value, origin or t)


def _misfit(value: Any, t: Any, at: str) -> tuple[Any, str] | None:
    """(the value that does not fit checkable annotation `t`, where it is inside the argument `at`: "" for the
    argument itself, " at xs[1]" for an item), or None where `value` fits."""
    t = _unannotated(t)
    origin, args = typing.get_origin(t), typing.get_args(t)
    if origin in (typing.Union, types.UnionType):
        # the member whose outer type the value has says which item is wrong: `[1, 'a']` for `list[int] | None`
        members = [a for a in args if _shape_fits(value, a)]
        misfits = [_misfit(value, a, at) for a in members]
        if any(m is None for m in misfits):
            return None
        return misfits[0] if misfits else (value, "")
    if not _shape_fits(value, t):
        return value, ""
    if origin is list:
        for i, item in enumerate(value):
            if (m := _misfit(item, args[0], f"{at}[{i}]")) is not None:
                return m[0], m[1] or f" at {at}[{i}]"
    elif origin is dict:
        for key, item in value.items():
            if not isinstance(key, str):
                return key, f" as a key of {at}"
            if (m := _misfit(item, args[1], f"{at}[{key!r}]")) is not None:
                return m[0], m[1] or f" at {at}[{key!r}]"
    return None


def _value_text(value: Any) -> str:
    """`'three' (str)`: a value and its type, its repr cut short."""
    text = repr(value)
    text = text if len(text) <= 60 else text[:57] + "..."
    return text if value is None else f"{text} ({type(value).__name__})"


def _annotations(target: Any, sig: inspect.Signature) -> dict[str, Any]:
    """The annotations of `sig`'s parameters, string ones (`from __future__ import annotations`) resolved by
    `typing.get_type_hints` on the class's `__init__` or the function; a string that does not resolve is left out,
    and so are all of them where resolving raises."""
    out = {name: p.annotation for name, p in sig.parameters.items()
           if p.annotation is not p.empty and not isinstance(p.annotation, str)}
    if len(out) < sum(p.annotation is not p.empty for p in sig.parameters.values()):
        function = target.__init__ if isinstance(target, type) else target
        try:
            hints = typing.get_type_hints(function) if inspect.isroutine(function) else {}
        except Exception:  # noqa: BLE001 (it evaluates the user's annotations: NameError, TypeError, ...)
            hints = {}
        out.update({name: hints[name] for name, p in sig.parameters.items()
                    if isinstance(p.annotation, str) and name in hints})
    return out


def _type_problem(target: Any, sig: inspect.Signature, init_args: dict) -> tuple[str, str] | None:
    """(`step`, `step must be int, got 'three' (str)`): the first of `init_args` whose value its parameter's
    annotation refuses, where the annotation is one `_checkable` exactly; None when all fit."""
    if hasattr(target, "__pydantic_validator__") or hasattr(target, "__get_validators__"):
        return None   # pydantic converts what it is given ('3' for an int): its own validation decides
    annotations = None
    for name, value in init_args.items():
        p = sig.parameters.get(name)
        if p is None or p.kind not in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) or p.annotation is p.empty:
            continue
        if annotations is None:
            annotations = _annotations(target, sig)
        t = annotations.get(name, p.empty)
        if t is p.empty or not _checkable(t) or (m := _misfit(value, t, name)) is None:
            continue
        bad, where = m
        from framework.yaml12 import bool_hint

        hint = bool_hint(bad) if _unannotated(t) is bool or bool in typing.get_args(_unannotated(t)) else ""
        return name, f"{name} must be {_type_text(t)}, got {_value_text(bad)}{where}{hint}"
    return None


class _Written(str):
    """An annotation kept as the text its module wrote (`from __future__ import annotations`), shown without the
    quotes that a signature puts around a string."""

    def __repr__(self) -> str:
        return str(self)


def _unquoted(sig: inspect.Signature) -> inspect.Signature:
    """`sig` as its source reads: `step: int`, not `step: 'int'`."""
    return sig.replace(parameters=[p.replace(annotation=_Written(p.annotation)) if isinstance(p.annotation, str)
                                   else p for p in sig.parameters.values()])


def check_init_args(target: Any, init_args: dict, class_path: str, complete: bool = False) -> None:
    """InitArgsError if `target` cannot accept these keyword arguments (missing ones may come later as extras, unless
    they are `complete`), or one's value is not of its parameter's annotation, where that is one fw checks exactly
    (`_checkable`)."""
    try:
        sig = _unquoted(inspect.signature(target))
    except (TypeError, ValueError):  # builtins without a signature: let the call decide
        return
    try:
        sig.bind_partial(**init_args)   # first: a misspelt name is the problem, not the missing one it was meant for
        if complete:
            sig.bind(**init_args)
    except TypeError as e:
        names = [n for n, p in sig.parameters.items()
                 if not n.startswith("_") and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        refused = [k for k, v in init_args.items() if _refuses(sig, k, v)]
        raise InitArgsError(f"init_args do not fit {class_path}{sig}: {e} (accepted: {', '.join(names) or 'none'})",
                            refused) from e
    problem = _type_problem(target, sig, init_args)
    if problem is not None:
        raise InitArgsError(f"init_args do not fit {class_path}{sig}: {problem[1]}", [problem[0]])


def instantiate(spec: dict, **extra: Any) -> Any:
    """Build `spec["class_path"](**spec["init_args"], **extra)`; `init_args` may be absent."""
    if not isinstance(spec, dict) or not isinstance(spec.get("class_path"), str):
        raise FwError(f"expected a mapping with a 'class_path' string, got {spec!r}")
    class_path = spec["class_path"]
    init_args = spec.get("init_args") or {}
    if not isinstance(init_args, dict):
        raise FwError(f"init_args of {class_path} must be a mapping, got {type(init_args).__name__}")
    clash = sorted(set(init_args) & set(extra))
    if clash:
        raise FwError(f"init_args of {class_path} set {', '.join(clash)}, which fw passes itself; remove them")
    target = import_object(class_path)
    if not callable(target):
        raise FwError(f"'{class_path}' is a {type(target).__name__}, which cannot be called")
    kwargs = {**init_args, **extra}
    check_init_args(target, kwargs, class_path, complete=True)
    try:
        return target(**kwargs)
    except FwError:
        raise
    except (Exception, SystemExit) as e:  # the user's constructor: one line, the traceback under --debug
        raise FwError(f"{class_path}(**init_args) {what_raised(e)}{user_line(e)}") from e


# The user objects that `instantiate_once` built in the open `built_once()` scope, by where and spec; None outside one.
_BUILT: dict[tuple[str, str], Any] | None = None


@contextlib.contextmanager
def built_once() -> Iterator[None]:
    """A scope in which `instantiate_once` builds each user object once: the checks of a config and the run that
    follows them in one process (`fw fit`) share it, so a constructor's side effects (a tracking run opened, a
    directory made, a thread started) happen once a process."""
    global _BUILT
    outer = _BUILT
    _BUILT = {} if outer is None else outer
    try:
        yield
    finally:
        _BUILT = outer


def instantiate_once(spec: dict, where: str) -> Any:
    """`instantiate(spec)`; within `built_once()`, the object built there before for `where` (the config key that
    names it, `callbacks[0]`) from an equal spec. A constructor that raises leaves nothing: the next call raises
    again, as the checks and the run each report it where they meet it."""
    return once(where, spec, lambda: instantiate(spec))


def once(where: str, spec: Any, build: Callable[[], Any]) -> Any:
    """`build()`; within `built_once()`, what it returned there before for `where` and an equal `spec` (anything
    JSON writes). A `build` that raises leaves nothing."""
    if _BUILT is None:
        return build()
    key = (where, json.dumps(spec, sort_keys=True, default=repr))
    if key not in _BUILT:
        _BUILT[key] = build()
    return _BUILT[key]
