"""Setting the GPU checks up from a plain working tree (what ``tests/gpu/conftest.py`` runs first).

The GPU machine has torch, triton, numpy and pytest, no vLLM, no pydantic, no network, and gets the
repository as a plain tree: the repository root goes on ``sys.path``; the packages of ``pyproject.toml``'s
``package-dir`` (``vtoken_sdk``, ``runtime`` -> ``vtoken_runtime``, ``policies`` -> ``vtoken_policies``,
``benchmarks`` -> ``vtoken_bench``) are registered under their installed names from this tree unless an
install of this same tree is importable; missing pure-Python or compiled dependencies are taken from
``*.whl`` files in the wheel folder (``VTOKEN_GPU_WHEELS``; default: ``shared/wheels`` or ``wheels`` in the
repository root, or ``../shared/wheels``): pure wheels go on ``sys.path`` as zip files, wheels with
extension modules are extracted once to a temp folder. The report's ``setup`` says what came from where.
torch is never installed. When this tree is installed (the development venv) nothing is added or aliased.

Wheels to carry to a Python 3.12 x86_64 machine without pydantic (vtoken_sdk needs pydantic v2, whose
core is compiled, so its wheel must match the interpreter; sizes from PyPI for the versions pinned in
this repository's venv):
    pydantic-2.14.4-py3-none-any.whl                                            ~495 KB
    pydantic_core-2.50.5-cp312-cp312-manylinux2014_x86_64.manylinux_2_17_x86_64.whl  ~2.26 MB
    annotated_types-0.8.0-py3-none-any.whl                                      ~13 KB
    typing_inspection-0.4.5-py3-none-any.whl                                    ~15 KB
    typing_extensions-4.16.0-py3-none-any.whl (only if torch's is older)         ~46 KB
(``pip download --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64
--implementation cp --abi cp312 pydantic==2.14.4 -d shared/wheels``, ~2.8 MB in all; not in git.)
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os
import platform
import re
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
# pyproject.toml [tool.setuptools] package-dir: installed name -> folder (the CLI is not needed here)
PACKAGES = {"vtoken_sdk": "vtoken_sdk", "vtoken_runtime": "runtime", "vtoken_policies": "policies",
            "vtoken_bench": "benchmarks"}
DEVICES = ("auto", "cuda", "cpu")


def log(*a: object) -> None:
    print(*a, file=sys.stderr, flush=True)


def version_tuple(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", v)[:4])


def wheel_tops(zf: zipfile.ZipFile) -> list[str]:
    """Top-level importable names in a wheel (folders and modules, not *.dist-info / *.data)."""
    tops = set()
    for n in zf.namelist():
        head = n.split("/", 1)[0]
        if head.endswith((".dist-info", ".data")):
            continue
        if "/" in n:
            tops.add(head)
        elif head.endswith(".py"):
            tops.add(head[:-3])
    return sorted(tops)


def add_wheels(dirs: list[Path]) -> list[dict[str, Any]]:
    """Put wheels whose packages are missing (or older installed) on ``sys.path``; see module doc."""
    out: list[dict[str, Any]] = []
    py = f"cp{sys.version_info.major}{sys.version_info.minor}"
    arch = platform.machine()
    seen: set[str] = set()
    for d in dirs:
        for whl in sorted(d.glob("*.whl")) if d.is_dir() else []:
            parts = whl.name[:-4].split("-")
            if len(parts) not in (5, 6):
                out.append({"wheel": whl.name, "used": False, "why": "not a wheel file name"})
                continue
            dist, ver, pytag, abi, plat = parts[0], parts[1], parts[-3], parts[-2], parts[-1]
            if dist.lower() in seen:
                continue
            rec: dict[str, Any] = {"wheel": whl.name, "bytes": whl.stat().st_size, "used": False}
            out.append(rec)
            pure = abi == "none" and plat == "any"
            if not pure and (py not in pytag.split(".") or abi not in (py, "abi3", "none")
                             or not sys.platform.startswith("linux") or arch not in plat):
                rec["why"] = f"not for this interpreter ({py}, {sys.platform}, {arch})"
                continue
            with zipfile.ZipFile(whl) as zf:
                tops = wheel_tops(zf)
                try:
                    installed = importlib.metadata.version(dist.replace("_", "-"))
                except importlib.metadata.PackageNotFoundError:
                    installed = None
                present = all(importlib.util.find_spec(t) is not None for t in tops)
                newer = installed is not None and version_tuple(ver) > version_tuple(installed)
                if present and not newer:
                    rec["why"] = f"already importable ({installed or 'unversioned'})"
                    continue
                if pure:
                    path = str(whl)
                    rec["how"] = "zip on sys.path"
                else:
                    dest = Path(tempfile.gettempdir()) / f"vtoken-wheels-{os.getuid()}" / f"{whl.stem}-{whl.stat().st_size}"
                    if not (dest / ".complete").exists():
                        dest.mkdir(parents=True, exist_ok=True)
                        zf.extractall(dest)
                        (dest / ".complete").write_text("ok")
                    path = str(dest)
                    rec["how"] = f"extracted to {dest}"
            if newer:  # an older installed copy would shadow it
                sys.path.insert(1, path)
                rec["why"] = f"installed {installed} is older than {ver}"
            else:
                sys.path.append(path)
            rec.update(used=True, provides=tops)
            seen.add(dist.lower())
    importlib.invalidate_caches()
    return out


def alias_packages() -> dict[str, str]:
    """Make the installed package names import from this tree (see module doc)."""
    out = {}
    for name, folder in PACKAGES.items():
        pkg = (ROOT / folder).resolve()
        mod = sys.modules.get(name)
        try:
            spec = mod.__spec__ if mod is not None else importlib.util.find_spec(name)
        except (ImportError, ValueError):
            spec = None
        origin = Path(spec.origin).resolve().parent if spec is not None and spec.origin else None
        if origin == pkg:
            out[name] = "this tree, on sys.path" if name == folder else f"this tree ({folder}/), installed"
            continue
        if mod is not None:
            out[name] = f"already imported from {origin}: not replaced"
            continue
        spec = importlib.util.spec_from_file_location(name, pkg / "__init__.py", submodule_search_locations=[str(pkg)])
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except Exception as e:
            del sys.modules[name]
            out[name] = f"alias FAILED: {type(e).__name__}: {e}"
            continue
        out[name] = f"alias of {folder}/" + (f" (an install at {origin} is ignored)" if origin else "")
    return out


def tree_is_installed() -> bool:
    """Whether every package of :data:`PACKAGES` already imports from this tree (an editable install)."""
    for name, folder in PACKAGES.items():
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            return False
        if spec is None or not spec.origin or Path(spec.origin).resolve().parent != (ROOT / folder).resolve():
            return False
    return True


def setup_environment(smoke: bool, device: str = "auto", wheels: Path | None = None) -> dict[str, Any]:
    """Wheels -> torch -> device / TRITON_INTERPRET -> package aliases, in that order.

    Returns the report's ``setup``: ``device`` is ``"cuda"`` or ``"cpu"``; ``skip`` (no CUDA and not
    ``smoke``: the checks did not run) or ``error`` (a set-up that cannot run the checks) when set."""
    if device not in DEVICES:
        raise ValueError(f"VTOKEN_GPU_DEVICE={device!r}; expected one of {DEVICES}")
    info: dict[str, Any] = {"root": str(ROOT)}
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    dirs = [wheels] if wheels else [ROOT / "shared" / "wheels", ROOT / "wheels", ROOT.parent / "shared" / "wheels"]
    if tree_is_installed():
        info["wheel_dirs"], info["wheels"] = [], []
    else:
        info["wheel_dirs"] = [str(d) for d in dirs if d.is_dir()]
        info["wheels"] = add_wheels(dirs)
    import torch  # after the wheels: a newer typing_extensions wheel must win

    cuda = torch.cuda.is_available() and device != "cpu"
    if device == "cuda" and not cuda:
        info["error"] = "VTOKEN_GPU_DEVICE=cuda but torch.cuda.is_available() is False"
    if not cuda:
        if not smoke:
            info["skip"] = ("no CUDA device (torch.cuda.is_available() is False): the GPU checks did not run; "
                            "VTOKEN_GPU_SMOKE=1 (scripts/gpu_check.sh --smoke) runs them tiny on CPU under the "
                            "Triton interpreter")
        elif "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
            info["error"] = "smoke checks on CPU need TRITON_INTERPRET=1 before triton is imported"
        else:
            os.environ["TRITON_INTERPRET"] = "1"
    elif os.environ.get("TRITON_INTERPRET") == "1":
        log("warning: TRITON_INTERPRET=1 on a CUDA machine: kernels run in the interpreter, timings are meaningless")
    info["triton_interpret"] = os.environ.get("TRITON_INTERPRET", "0") == "1"
    info["packages"] = alias_packages()
    mods: dict[str, str] = {}
    for dep in () if "skip" in info else ("numpy", "triton", "pydantic", "pydantic_core", "numba"):
        try:
            m = importlib.import_module(dep)
            mods[dep] = f"{getattr(m, '__version__', '?')} from {Path(m.__file__ or '?').parent}"
        except Exception as e:
            mods[dep] = f"MISSING ({type(e).__name__}: {e})"
    info["modules"] = mods
    info["device"] = "cuda" if cuda else "cpu"
    return info
