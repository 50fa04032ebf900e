"""``vtoken-cli validate`` and ``vtoken-cli list``."""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import re
import signal
import sys
import tempfile
import time
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

if TYPE_CHECKING:
    from vtoken_sdk.errors import PolicyDefinitionError

    # what checking one file yields: a load error, or (policy, its line, one check's result)
    FileEvent = PolicyDefinitionError | tuple[str, int, dict[str, Any]]

out = Console(width=None if sys.stdout.isatty() else 160)
err = Console(stderr=True, width=None if sys.stderr.isatty() else 160)


def validate(
    files: Annotated[list[Path], typer.Argument(help="policy files (.py) to check", show_default=False)],
    examples: Annotated[int, typer.Option("--examples", "-n", min=1, help="hypothesis examples per property")] = 200,
    as_json: Annotated[bool, typer.Option("--json", help="machine-readable report on stdout")] = False,
    timeout: Annotated[float, typer.Option(
        "--timeout", min=0.1, help="seconds allowed to load (import and decorate) each file; a file still running "
        "then is stopped and reported with the line it was executing")] = 10.0,
    check_timeout: Annotated[float, typer.Option(
        "--check-timeout", min=0.1, help="seconds allowed for all the checks of one policy")] = 300.0,
) -> None:
    """Import each FILE in isolation, find its policies and check them against the contract.

    Each file is loaded and checked in a child process: a file that loops forever is
    stopped after --timeout seconds (a policy whose checks hang, after --check-timeout),
    and one that exits or crashes the interpreter is reported; the other files are still
    checked. Each check ends PASS, FAIL or SKIP (it did not run here, e.g. backend_equal
    without CUDA or TRITON_INTERPRET=1; the detail says why); the last line counts each,
    and --json gives every row a "status" and the counts ("passed", "failed", "skipped").
    Exit code 0 when nothing failed, 1 when a check or a definition fails, 2 on usage
    errors (a missing file, a directory).
    """
    problems = [(f, why) for f in files if (why := _not_a_policy_file(f)) is not None]
    if problems:
        for f, why in problems:
            err.print(f"[bold red]error[/] {escape(str(f))}: {why}", highlight=False, markup=True, soft_wrap=True)
        raise typer.Exit(2)

    from vtoken_sdk.checks import CHECKS
    from vtoken_sdk.errors import PolicyDefinitionError

    if _START_METHOD == "fork" and len(files) > 1:
        _warm_up()

    rows: list[dict[str, object]] = []
    failed = False
    for f in files:
        for event in _check_file(f, examples, timeout, check_timeout):
            if isinstance(event, PolicyDefinitionError):
                e = event
                if f.name == "__init__.py" and e.message.startswith("no policy"):
                    err.print(f"skipped {f} (package marker without policies)", highlight=False)
                    continue
                failed = True
                err.print(f"[bold red]error[/] {escape(e.render())}", highlight=False, markup=True, soft_wrap=True)
                rows.append({"file": str(f), "policy": None, "check": e.check, "status": "fail", "detail": e.message,
                             "location": e.location, "hint": e.hint})
                continue
            pol_name, pol_line, r = event
            loc = f"{f}:{r['line'] or pol_line}"
            rows.append({"file": str(f), "policy": pol_name, "check": r["name"], "status": r["status"],
                         "detail": r["detail"], "example": r["example"] or None, "location": loc})
            if r["status"] == "fail":
                failed = True
                err.print(f"[bold red]FAIL[/] {loc}: policy {pol_name!r} check {r['name']}: {r['detail']}",
                          highlight=False, soft_wrap=True)
                if r["example"]:
                    err.print(f"  falsifying example: {r['example']}", highlight=False, soft_wrap=True)
    counts = {word: sum(r["status"] == st for r in rows) for st, word in _COUNTED}
    if as_json:
        sys.stdout.write(json.dumps({"ok": not failed, **counts, "checks": CHECKS, "results": rows}, indent=2) + "\n")
    else:
        table = Table(title="vtoken-cli validate", show_lines=False)
        for col in ("file", "policy", "check", "result", "detail"):
            table.add_column(col, overflow="fold")
        for r in rows:
            table.add_row(str(r["file"]), str(r["policy"] or "-"), str(r["check"]), _SHOWN[str(r["status"])],
                          str(r["detail"])[:120])
        out.print(table)
        out.print(", ".join(f"{n} {word}" for word, n in counts.items()))
    raise typer.Exit(1 if failed else 0)


# a result row's status: how the table shows it, and the word of the closing count line / the JSON key
_SHOWN = {"pass": "[green]PASS[/]", "fail": "[red]FAIL[/]", "skip": "[yellow]SKIP[/]"}
_COUNTED = (("pass", "passed"), ("fail", "failed"), ("skip", "skipped"))


def _not_a_policy_file(f: Path) -> str | None:
    """Why ``f`` cannot be validated at all (a usage error, exit 2), or None."""
    if f.is_dir():
        return "is a directory (pass the policy files in it, e.g. dir/*.py)"
    if not f.exists():
        return "no such file"
    if not f.is_file():
        return "not a regular file"
    return None


# --------------------------------------------------------------------------- isolation
#
# Every file is loaded and checked in a child process that streams its results back over
# a pipe. On Linux the child is forked from this process, which has already imported
# torch, hypothesis and the SDK, so a child costs milliseconds (a spawned one would import
# torch again, seconds per run); elsewhere it is spawned. The child enforces the time
# limits itself with faulthandler.dump_traceback_later, whose watchdog is a C thread: it
# fires even when the policy holds the GIL in C code, writes every thread's stack to a
# file (from which the line being executed is read) and _exits the child. The parent also
# kills the child GRACE_S after a limit, in case it did not go.

_START_METHOD = "fork" if sys.platform.startswith("linux") else "spawn"
GRACE_S = 3.0
START_S = 120.0  # a spawned (not forked) child imports torch before it starts the clock

# In place of a message from the child: it exited (or its pipe broke), or the deadline passed.
_DEAD, _LATE = "dead", "late"


def _warm_up() -> None:
    """Check a one-line policy here, once, before the children fork: hypothesis and torch
    pay their first-use costs (a gc pass when hypothesis registers torch's RNG, collecting
    constants, first calls into torch), about 0.3 s, in the parent instead of in every child.
    Only an optimisation: a failure here is left for the children to meet and report."""
    import vtoken_sdk as vt
    import vtoken_sdk.loader  # noqa: F401 - inherited by the children
    from vtoken_sdk.checks import run_checks

    def warm_up(s: vt.TokenStats) -> Any:
        return s.attn_sum

    with contextlib.suppress(Exception):
        run_checks(vt.policy(budget=vt.Budget(ratio=0.5))(warm_up), examples=2,
                   only=("score_shape", "batch_invariant"))


def _check_file(f: Path, examples: int, timeout: float, check_timeout: float) -> Iterator[FileEvent]:
    """Load and check ``f`` in child processes: a load error (``PolicyDefinitionError``) or
    ``(policy, line, result)`` per check. After a policy's checks time out or kill the child,
    a new child checks the file's next policies."""
    first: int | None = 0
    while first is not None:
        first = yield from _run_child(f, examples, timeout, check_timeout, first)


def _run_child(f: Path, examples: int, timeout: float, check_timeout: float, first: int
               ) -> Generator[FileEvent, None, int | None]:
    import multiprocessing
    from multiprocessing.connection import wait

    from vtoken_sdk.errors import PolicyDefinitionError

    ctx = multiprocessing.get_context(_START_METHOD)
    fd, dump = tempfile.mkstemp(prefix="vtoken-validate-", suffix=".txt")
    os.close(fd)
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(send, str(f), examples, timeout, check_timeout, first, dump),
                       name=f"vtoken-validate {f}")
    phase, limit = "load", timeout
    deadline = time.monotonic() + START_S
    policies: list[tuple[str, int]] = []
    current: tuple[int, str] = (first, "definition")
    try:
        proc.start()
        send.close()
        while True:
            ready = wait([recv, proc.sentinel], timeout=max(0.0, deadline - time.monotonic()))
            msg: Any = _LATE
            if recv in ready or (proc.sentinel in ready and recv.poll(0)):
                try:
                    msg = recv.recv()
                except (EOFError, OSError, pickle.UnpicklingError):
                    msg = _DEAD
            elif proc.sentinel in ready:
                msg = _DEAD
            if msg == _LATE:
                _dump_stack_and_kill(proc, dump)
            if msg in (_DEAD, _LATE) or msg[0] == "raised":
                proc.join()
                line, elsewhere = _line_from_dump(dump, f)
                if msg not in (_DEAD, _LATE) and msg[2] is not None:
                    line = msg[2]
                why = _why_stopped(msg, proc.exitcode, dump, phase, limit, line, elsewhere)
                if phase == "load":
                    yield PolicyDefinitionError(why, file=str(f), line=line, check="load")
                    return None
                i, check = current
                name, pol_line = policies[i]
                yield name, pol_line, {"name": check, "status": "fail", "detail": why, "example": "", "line": line}
                return i + 1 if i + 1 < len(policies) else None
            kind = msg[0]
            if kind == "ready":
                deadline = time.monotonic() + timeout + GRACE_S
            elif kind == "loaded":
                if msg[1] is not None:
                    yield PolicyDefinitionError(**msg[1])
                    return None
                policies = msg[2]
                phase, limit = "checks", check_timeout
                deadline = time.monotonic() + check_timeout + GRACE_S
            elif kind == "policy":
                current = (msg[1], "definition")
                deadline = time.monotonic() + check_timeout + GRACE_S
            elif kind == "check":
                current = (msg[1], msg[2])
            elif kind == "result":
                name, pol_line = policies[msg[1]]
                yield name, pol_line, msg[2]
            elif kind == "done":
                return None
    finally:
        if proc.is_alive():
            proc.kill()
        if proc.pid is not None:
            proc.join()
        recv.close()
        with contextlib.suppress(OSError):
            os.unlink(dump)


def _dump_stack_and_kill(proc: Any, dump: str) -> None:
    """The child's own timer did not stop it: ask it for its stack (SIGUSR1, see ``_child``), then kill it."""
    usr1 = getattr(signal, "SIGUSR1", None)
    if usr1 is not None and proc.pid is not None:
        with contextlib.suppress(OSError):
            os.kill(proc.pid, usr1)
            for _ in range(20):  # the dump is written by a C signal handler: at once, or never
                if os.path.getsize(dump):
                    break
                time.sleep(0.025)
    proc.kill()


def _why_stopped(msg: Any, exitcode: int | None, dump: str, phase: str, limit: float, line: int | None,
                 elsewhere: str | None) -> str:
    """One line: why the child stopped before it finished ``phase`` ("load" or "checks")."""
    doing = "loading the file" if phase == "load" else "running the check"
    if msg == _LATE or _read(dump).startswith("Timeout ("):
        notes = ["still executing this line" if line else f"executing {elsewhere}" if elsewhere else "",
                 "raise --timeout if the file is only slow" if phase == "load" else
                 "raise --check-timeout if the checks are only slow"]
        return f"{doing} timed out after {limit:g} s ({'; '.join(n for n in notes if n)})"
    if msg != _DEAD:  # ("raised", text, line): user code raised SystemExit/KeyboardInterrupt
        return f"{doing} raised {msg[1]}"
    if exitcode is not None and exitcode < 0:
        try:
            how = f"was killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            how = f"was killed by signal {-exitcode}"
    else:
        how = f"exited with code {exitcode}"
    at = f" in {elsewhere}" if elsewhere and not line else ""
    return f"the process {doing} {how}{at}"


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            return fh.read()
    except OSError:
        return ""


_FRAME = re.compile(r'^\s*File "(?P<file>.*)", line (?P<line>\d+) in ', re.M)


def _line_from_dump(dump: str, f: Path) -> tuple[int | None, str | None]:
    """From a faulthandler dump (innermost frame first): the line of ``f`` being executed,
    or else where the innermost frame was (``file:line``, e.g. in a module the file imports)."""
    frames = [(m["file"], int(m["line"])) for m in _FRAME.finditer(_read(dump))]
    real = str(f.resolve())
    for file, line in frames:
        if file == real:
            return line, None
    return None, (f"{frames[0][0]}:{frames[0][1]}" if frames else None)


def _child(conn: Any, path: str, examples: int, timeout: float, check_timeout: float, first: int,
           dump_path: str) -> None:
    """The child: load ``path`` and check its policies from index ``first``, streaming messages."""
    import faulthandler

    from vtoken_sdk.errors import traceback_line_in_file

    dump = open(dump_path, "w")  # noqa: SIM115 - lives as long as the process
    # a crash (SIGSEGV...) leaves the stack, hence the line, too. disable() first: enable() on an already
    # enabled faulthandler (pytest enables it in the parent we forked from) only swaps the file and does
    # not reinstall its signal handlers, and a native library loaded in the parent since (an in-process
    # vLLM engine) may have replaced them: the crash then left an empty dump and no line
    faulthandler.disable()
    faulthandler.enable(file=dump)
    if hasattr(faulthandler, "register"):  # POSIX: the parent's SIGUSR1 asks for the stack before it kills us
        faulthandler.register(signal.SIGUSR1, file=dump, all_threads=True)
    sys.stdout = sys.stderr  # what the file prints must not end up in the report on stdout
    with contextlib.suppress(OSError, ValueError):
        os.dup2(2, 1)
    real = str(Path(path).resolve())
    try:
        from vtoken_sdk.checks import CHECKS, run_checks
        from vtoken_sdk.loader import load_policy_file

        conn.send(("ready",))
        faulthandler.dump_traceback_later(timeout, exit=True, file=dump)
        loaded = load_policy_file(path)
        faulthandler.cancel_dump_traceback_later()
        e = loaded.error
        conn.send(("loaded", None if e is None else
                   {"message": e.message, "file": e.file, "line": e.line, "hint": e.hint, "check": e.check},
                   [(p.name, p.line) for p in loaded.policies]))
        if e is None:
            for i, pol in enumerate(loaded.policies[first:], start=first):
                conn.send(("policy", i))
                faulthandler.dump_traceback_later(check_timeout, exit=True, file=dump)
                failing: list[object] = []  # one policy's falsifying examples, tried first by its later checks
                for name in CHECKS:
                    conn.send(("check", i, name))
                    for r in run_checks(pol, examples=examples, only=(name,), failing=failing).results:
                        conn.send(("result", i, {"name": r.name, "status": r.status, "detail": r.detail,
                                                 "example": r.example, "line": r.line}))
                faulthandler.cancel_dump_traceback_later()
        conn.send(("done",))
    except BaseException as exc:  # noqa: BLE001 - e.g. SystemExit from a mask function; reported by the parent
        faulthandler.cancel_dump_traceback_later()
        with contextlib.suppress(Exception):
            conn.send(("raised", f"{type(exc).__name__}: {exc}", traceback_line_in_file(exc.__traceback__, real)))
    finally:
        conn.close()


def list_policies(
    as_json: Annotated[bool, typer.Option("--json", help="machine-readable list on stdout")] = False,
) -> None:
    """Show the shipped policies with their parameters."""
    import vtoken_policies

    items = []
    for name in vtoken_policies.names():
        p = vtoken_policies.load(name)
        items.append({
            "name": p.name, "file": str(vtoken_policies.path(name)), "score": p.describe(),
            "reads": sorted(p.reads), "granularity": p.granularity,
            "allocation": p.allocation.model_dump(), "budget": p.budget.model_dump(exclude_none=True),
            "protect": [type(r).__name__ + "(" + ", ".join(f"{k}={v}" for k, v in r.model_dump().items()
                                                         if k not in ("fn", "node")) + ")" for r in p.spec.protect],
            "stats": p.spec.stats.model_dump(), "doc": p.doc.splitlines()[0] if p.doc else "",
        })
    if as_json:
        sys.stdout.write(json.dumps(items, indent=2) + "\n")
        return
    table = Table(title="shipped policies")
    for col in ("name", "score", "budget", "protect", "granularity", "allocation", "reads", "paper"):
        table.add_column(col, overflow="fold")
    for it in items:
        b, a = it["budget"], dict(it["allocation"])  # type: ignore[call-overload]
        alloc = str(a.pop("kind")) + "".join(f" {k}={v}" for k, v in a.items())
        table.add_row(str(it["name"]), str(it["score"]), ", ".join(f"{k}={v}" for k, v in b.items()),  # type: ignore[union-attr]
                      ", ".join(it["protect"]), str(it["granularity"]), alloc, ", ".join(it["reads"]),  # type: ignore[arg-type]
                      str(it["doc"]))
    out.print(table)
