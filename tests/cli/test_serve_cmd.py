"""``vtoken-cli serve``'s command as a user meets it: ``--print-command`` is one line a shell runs with the
arguments and environment ``serve`` itself would use, creating nothing; the server listens on 127.0.0.1 unless
``--host`` says otherwise; the dtype line; and the server launcher (``python -m vtoken_cli.serve_cmd``) removes
its prometheus directory when the server exits, also on SIGTERM, and those of earlier killed servers."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

CLI = [sys.executable, "-c", "from vtoken_cli.main import main; main()"]
MANAGED = ("VLLM_USE_V2_MODEL_RUNNER", "VLLM_CPU_OMP_THREADS_BIND", "VLLM_USE_AOT_COMPILE",
           "ONEDNN_PRIMITIVE_CACHE_CAPACITY", "PROMETHEUS_MULTIPROC_DIR")


def _model(tmp_path: Path, dtype: str = "float32") -> Path:
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "llama", "dtype": dtype}))
    return d


def _env(tmp: Path) -> dict[str, str]:
    tmp.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in MANAGED}
    return {**env, "TMPDIR": str(tmp), "CUDA_VISIBLE_DEVICES": ""}


def _print_command(tmp_path: Path, *args: str) -> tuple[str, str]:
    res = subprocess.run([*CLI, "serve", str(_model(tmp_path)), *args, "--print-command"], capture_output=True,
                         text=True, env=_env(tmp_path / "tmp"), timeout=120)
    assert res.returncode == 0, res.stderr
    return res.stdout, res.stderr


def _split(line: str) -> tuple[dict[str, str], list[str]]:
    """``env K=V ... PROGRAM ARGS`` as a shell would parse it -> (environment, argv)."""
    toks = shlex.split(line)
    assert toks[0] == "env", line
    n = 1
    while "=" in toks[n] and not toks[n].startswith("-"):
        n += 1
    return dict(t.split("=", 1) for t in toks[1:n]), toks[n:]


def test_print_command_is_one_shell_line_with_serves_args_and_env_and_creates_nothing(tmp_path: Path) -> None:
    from vtoken_runtime.vllm_plugin import serve_flags

    out, err = _print_command(tmp_path, "--policy", "h2o", "--eviction-ratio", "0.5", "--port", "8123",
                              "--max-model-len", "1024")
    assert len(out.splitlines()) == 1
    env, argv = _split(out)
    assert env == {"VLLM_USE_V2_MODEL_RUNNER": "0", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_USE_AOT_COMPILE": "0",
                   "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "128"}
    model = str(tmp_path / "model")
    flags = serve_flags(policy="h2o", eviction_ratio=0.5)
    assert argv == [sys.executable, "-m", "vtoken_cli.serve_cmd", "--model", model, "--host", "127.0.0.1",
                    "--kv-cache-memory-bytes", str(1 << 30), *flags, "--port", "8123", "--max-model-len", "1024"]
    extra = json.loads(argv[argv.index("--additional-config") + 1])
    assert extra["vtoken"]["policy"] == "h2o" and extra["vtoken"]["eviction_ratio"] == 0.5
    assert "policy=h2o" in err
    # a shell runs the line as printed: the program gets exactly these arguments and this environment
    probe = ("import json, os, sys; print(json.dumps([sys.argv[1:], {k: os.environ.get(k) for k in "
             + repr(list(MANAGED)) + "}]))")
    shell_line = out.strip().replace(" -m vtoken_cli.serve_cmd ", f" -c {shlex.quote(probe)} ", 1)
    res = subprocess.run(["sh", "-c", shell_line], capture_output=True, text=True, env=_env(tmp_path / "tmp"),
                         timeout=60)
    assert res.returncode == 0, res.stderr
    got_args, got_env = json.loads(res.stdout)
    assert got_args == argv[3:]
    assert got_env == {**env, "PROMETHEUS_MULTIPROC_DIR": None}  # the launcher makes that directory, not serve
    assert not list((tmp_path / "tmp").iterdir())  # --print-command created nothing


def test_host_is_127_0_0_1_unless_given(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    _, argv = _split(_print_command(tmp_path / "a", "--host", "0.0.0.0")[0])
    assert [a for a in argv if a.startswith("--host")] == ["--host"] and argv[-2:] == ["--host", "0.0.0.0"]
    _, argv = _split(_print_command(tmp_path / "b", "--uds", str(tmp_path / "s.sock"))[0])
    assert "--host" not in argv


def test_dtype_line_says_what_runs(tmp_path: Path) -> None:
    from vtoken_cli.serve_cmd import dtype_line

    model = str(_model(tmp_path))
    auto = dtype_line(model, [], cuda=False)
    if sys.platform.startswith("linux") and os.uname().machine in ("x86_64", "aarch64"):
        assert auto.startswith("vtoken: dtype bfloat16 (--dtype auto") and "config says float32" in auto
    assert dtype_line(model, ["--dtype", "float32"], cuda=False).startswith("vtoken: dtype float32 (--dtype;")
    assert dtype_line(model, ["--dtype=bf16"], cuda=False).startswith("vtoken: dtype bfloat16 (--dtype;")
    assert "vec" in dtype_line(model, ["--dtype", "float32"], cuda=False)  # amx is a bf16 kernel
    assert "vLLM's choice" in dtype_line(str(tmp_path / "absent"), [], cuda=False)


def _launch(tmp: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "vtoken_cli.serve_cmd", *args], env=_env(tmp),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.slow  # imports vLLM in the launcher (~20 s)
def test_launcher_removes_its_directory_and_those_of_killed_servers(tmp_path: Path) -> None:
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    (tmp / f"vtoken-prometheus-{dead}").mkdir()  # a server killed with SIGKILL left it
    (tmp / f"vtoken-prometheus-{os.getpid()}").mkdir()  # a running server's: kept
    proc = _launch(tmp, "--model", str(_model(tmp_path)), "--no-such-vllm-flag")
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode != 0 and "no-such-vllm-flag" in out, out[-2000:]
    assert [p.name for p in tmp.glob("vtoken-prometheus-*")] == [f"vtoken-prometheus-{os.getpid()}"]


@pytest.mark.slow
def test_launcher_removes_its_directory_on_sigterm(tmp_path: Path) -> None:
    tmp = tmp_path / "tmp"
    proc = _launch(tmp, "--model", str(_model(tmp_path)))
    own = tmp / f"vtoken-prometheus-{proc.pid}"
    deadline = time.monotonic() + 60
    while not own.exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode != 0, out[-2000:]
    assert not list(tmp.glob("vtoken-prometheus-*"))
