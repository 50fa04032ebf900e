"""Load policy files in isolation and turn every failure into a located message."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import sys
import traceback
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import ValidationError

from .allocation import ALLOCATIONS
from .errors import PolicyDefinitionError, traceback_line_in_file
from .policy import Policy, _pydantic_message


@dataclass
class LoadedFile:
    path: Path
    policies: list[Policy] = field(default_factory=list)
    error: PolicyDefinitionError | None = None


NUMPY_HINT = ("write the score with torch or vt ops: np.log(x) -> x.log() or torch.log(x), "
              "np.maximum -> vt.maximum, np.where -> vt.where, np.clip -> x.clamp(); numbers like np.float32(2) are fine")

_NUMPY_ATTR = re.compile(r"\.(__array\w*__|numpy)\(\)")

# the SDK's frozen settings models a policy file constructs: a ValidationError names the one that refused
_SDK_MODELS = ("Budget", "StatsConfig", *(a.__name__ for a in ALLOCATIONS))


def _numpy_message(e: PolicyDefinitionError) -> str | None:
    """``numpy cannot be traced: ...`` when tracing a score failed because it called numpy, else None.

    Tracing hands the score function symbolic statistics (``vtoken_sdk.ir.Expr``); numpy
    probes them for ``__array_struct__``/``__array_interface__``/``__array__``, numpy's
    Python wrappers (``np.clip``, ``np.mean``) call array methods on them, and ``.numpy()``
    is asked of them directly. All of these surface as an "unsupported tensor method" or
    "got ndarray" error; a numpy frame in the traceback or one of those names says numpy.
    """
    np_mod = sys.modules.get("numpy")
    np_file = getattr(np_mod, "__file__", None)
    np_dir = os.path.dirname(np_file) + os.sep if np_file else None
    func = None
    for exc in (e, e.__context__):
        if exc is None or np_dir is None:
            continue
        for fs in traceback.extract_tb(exc.__traceback__):
            if fs.filename.startswith(np_dir):
                func = fs.name  # the outermost numpy frame: the np.<function> the score called
                break
        if func is not None:
            break
    attr = _NUMPY_ATTR.search(e.message)
    if func is None and attr is None and "got ndarray" not in e.message:
        return None
    if func is not None and not func.startswith("_"):
        what = f"np.{func}() was called on a statistic"
    elif attr is not None and attr.group(1) == "numpy":
        what = ".numpy() was called on a statistic"
    elif attr is not None or func is not None:
        what = "a numpy function was called on a statistic"
    else:
        what = "a numpy array was combined with a statistic"
    return f"numpy cannot be traced: {what} (a score function runs once, at decoration, on symbolic statistics)"


def load_policy_file(path: str | Path) -> LoadedFile:
    """Import ``path`` as a fresh module and collect its ``Policy`` objects.

    Never raises for problems in the file: a syntax error, an import error, a bad
    budget or an untraceable score function all come back as ``error`` with file:line.
    """
    p = Path(path)
    shown = str(p)
    out = LoadedFile(p)
    if not p.is_file():
        out.error = PolicyDefinitionError("no such file", file=shown, line=None, check="load")
        return out
    source = p.read_text(encoding="utf-8", errors="replace")
    real = str(p.resolve())
    try:
        compile(source, real, "exec")
    except SyntaxError as e:
        out.error = PolicyDefinitionError(f"syntax error: {e.msg}", file=shown, line=e.lineno, check="load",
                                          hint="fix the Python syntax")
        return out
    modname = "vtoken_user_" + hashlib.sha1(real.encode()).hexdigest()[:12]
    spec = importlib.util.spec_from_file_location(modname, real)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[modname] = module
    try:
        spec.loader.exec_module(module)
    except PolicyDefinitionError as e:
        e.file = shown if e.file == real else e.file
        message, hint = e.message, e.hint
        numpy_message = _numpy_message(e)
        if numpy_message is not None:
            message, hint = numpy_message, NUMPY_HINT
        out.error = PolicyDefinitionError(message, file=e.file, line=e.line, hint=hint, check=e.check)
        return out
    except ValidationError as e:
        out.error = PolicyDefinitionError(_pydantic_message(e), file=shown,
                                          line=traceback_line_in_file(e.__traceback__, real), check="definition",
                                          hint=f"see vtoken_sdk.{e.title} for valid values"
                                          if e.title in _SDK_MODELS else
                                          "see vtoken_sdk.Budget / vt.StatsConfig for valid values")
        return out
    except BaseException as e:  # noqa: BLE001 - anything the file does at import is reported, not raised
        if isinstance(e, KeyboardInterrupt):
            raise
        what = "import error" if isinstance(e, ImportError) else "error while importing"
        out.error = PolicyDefinitionError(f"{what}: {type(e).__name__}: {e}", file=shown,
                                          line=traceback_line_in_file(e.__traceback__, real), check="load")
        return out
    finally:
        sys.modules.pop(modname, None)
    seen: set[int] = set()
    for value in vars(module).values():
        if isinstance(value, Policy) and id(value) not in seen:
            seen.add(id(value))
            out.policies.append(value)
    if not out.policies:
        out.error = PolicyDefinitionError("no policy found in the file", file=shown, line=1, check="load",
                                          hint="decorate a score function with @vt.policy(budget=...)")
    return out
