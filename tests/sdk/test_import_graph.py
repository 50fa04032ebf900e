"""The SDK and the runtime import each other in one direction only: no module imports another that
(directly or through others) imports it back, counting imports inside functions too (a lazy import
hides a circle, it does not remove it). ``if TYPE_CHECKING:`` blocks are ignored."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"vtoken_sdk": ROOT / "vtoken_sdk", "vtoken_runtime": ROOT / "runtime"}


def _module_name(pkg: str, path: Path, base: Path) -> str:
    rel = path.relative_to(base).with_suffix("")
    parts = [pkg, *rel.parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(mod: str, path: Path, is_pkg: bool) -> set[str]:
    tree = ast.parse(path.read_text())
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for n in ast.walk(node))
    out = set()
    pkg = mod if is_pkg else mod.rsplit(".", 1)[0]
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            names = [f"{target}.{a.name}" for a in node.names]
            out.update([target, *names])
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return out


def _graph() -> dict[str, set[str]]:
    mods: dict[str, tuple[Path, bool]] = {}
    for pkg, base in PACKAGES.items():
        for p in base.rglob("*.py"):
            mods[_module_name(pkg, p, base)] = (p, p.name == "__init__.py")
    graph = {}
    for m, (p, is_pkg) in mods.items():
        graph[m] = {t for t in _imports(m, p, is_pkg) if t in mods and t != m}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for t in sorted(graph[n]):
            if state.get(t) == 1 and not t.startswith(n + ".") and not n.startswith(t + "."):
                return stack[stack.index(t):] + [t]
            if t not in state:
                found = visit(t)
                if found:
                    return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state:
            found = visit(n)
            if found:
                return found
    return None


def test_no_import_cycles() -> None:
    g = _graph()
    assert len(g) > 30
    cyc = _cycle(g)
    assert cyc is None, " -> ".join(cyc or [])


@pytest.mark.parametrize("planted", [("vtoken_sdk.backend", "vtoken_sdk.policy"),
                                     ("vtoken_sdk.torch_backend", "vtoken_sdk.backend"),
                                     ("vtoken_sdk.torch_backend", "vtoken_sdk.triton_backend")])
def test_a_planted_cycle_is_found(planted: tuple[str, str]) -> None:
    """An edge back along a real one (policy -> backend in Policy.compile, backend -> torch_backend /
    triton_backend in compile_policy, triton_backend -> torch_backend) closes a cycle the test reports."""
    g = _graph()
    a, b = planted
    assert a in g[b]
    g[a] = g[a] | {b}
    assert _cycle(g) is not None
