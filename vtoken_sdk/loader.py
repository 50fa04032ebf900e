"""Load policy files in isolation and turn every failure into a located message."""

from __future__ import annotations

import hashlib
import importlib.util
import sys
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import ValidationError

from .errors import PolicyDefinitionError, traceback_line_in_file
from .policy import Policy, _pydantic_message


@dataclass
class LoadedFile:
    path: Path
    policies: list[Policy] = field(default_factory=list)
    error: PolicyDefinitionError | None = None


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
        out.error = PolicyDefinitionError(e.message, file=e.file, line=e.line, hint=e.hint, check=e.check)
        return out
    except ValidationError as e:
        out.error = PolicyDefinitionError(_pydantic_message(e), file=shown,
                                          line=traceback_line_in_file(e.__traceback__, real), check="definition",
                                          hint="see vtoken_sdk.Budget / vt.StatsConfig for valid values")
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
