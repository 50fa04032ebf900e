"""Request admission: per-request options are validated in vLLM's frontend, before scheduling.

vLLM 0.32 runs ``validate_params(sampling_params)`` of every custom logits processor when a request
is admitted (``InputProcessor``, in the API-server process or in ``LLM.generate``'s process); a
ValueError there becomes an HTTP 400 naming the problem, or a ValueError from ``LLM.generate`` for
that request. :class:`VTokenOptions` is such a processor whose only job is that hook: it never changes
logits (argmax invariant, so vLLM skips it on the sampling path). ``vllm_engine_args`` /
``vtoken-cli serve`` register it as ``vtoken_runtime.vllm_plugin.frontend:VTokenOptions``.

Over HTTP that hook comes too late or not at all in two cases: a streamed request (``"stream": true``) is
admitted inside the event stream (vLLM answers 200, then an error event), and a ``vllm_xargs`` value of a
type vLLM's request model refuses (a nested list, the nested ``{"vtoken": {...}}`` form) is a pydantic 400
listing several union branches that never reaches the hook. :class:`VTokenRequestCheck`, an ASGI
middleware (vLLM's ``--middleware``; ``serve_flags`` / ``vtoken-cli serve`` add it), checks the
``vtoken*`` keys of a JSON body's ``vllm_xargs`` before vLLM reads the body: a bad value is a 400 with one
line naming the key and the accepted form, before any stream starts, counted in
``vtoken_rejected_requests_total``; everything else passes through untouched.
"""

from __future__ import annotations

import json
from typing import Any

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor

from .config import CONFIG_KEY, parse_request_options, request_options
from .metrics import counters

FQCN = "vtoken_runtime.vllm_plugin.frontend:VTokenOptions"
MIDDLEWARE = "vtoken_runtime.vllm_plugin.frontend.VTokenRequestCheck"
NESTED_OVER_HTTP = ("vtoken: vllm_xargs.vtoken: the nested form {\"vtoken\": {...}} is for Python's extra_args only "
                    "(vllm_xargs values must be flat); over HTTP use the flat keys, e.g. "
                    "{\"vtoken_budget_tokens\": 64, \"vtoken_pinned_spans\": [0, 16]}")


class VTokenOptions(LogitsProcessor):
    """Validates ``extra_args`` (the flat ``vtoken_*`` keys / the nested ``vtoken`` alias) at admission."""

    @classmethod
    def validate_params(cls, sampling_params: Any) -> None:
        try:
            request_options(sampling_params)
        except ValueError:
            counters().rejected.inc()
            raise

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        pass

    def is_argmax_invariant(self) -> bool:
        return True

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        pass

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return logits


def http_options_error(body: Any) -> tuple[str, str] | None:
    """``(message, param)`` when a request body's ``vtoken*`` keys are invalid, else None (no ``vtoken`` key, or
    a ``vllm_xargs`` that is not a mapping: vLLM's business). ``param`` is the key's path in the body. A
    ``vtoken*`` key at the top level of the body is an error too: vLLM drops fields it does not know without a
    word, so the option would silently do nothing."""
    if not isinstance(body, dict):
        return None
    top = sorted(k for k in body if isinstance(k, str) and k.startswith(CONFIG_KEY))
    if top:
        return (f"vtoken: {top[0]!r} at the top level of the request body is not read (vLLM ignores unknown "
                f"fields); per-request options go inside vllm_xargs, e.g. {{\"vllm_xargs\": {{\"{top[0]}\": ...}}}} "
                "(openai client: extra_body={\"vllm_xargs\": {...}})", top[0])
    xargs = body.get("vllm_xargs")
    if not isinstance(xargs, dict):
        return None
    ours = {k: v for k, v in xargs.items() if isinstance(k, str) and k.startswith(CONFIG_KEY)}
    if not ours:
        return None
    if CONFIG_KEY in ours:
        return NESTED_OVER_HTTP, f"vllm_xargs.{CONFIG_KEY}"
    try:
        parse_request_options(ours)
    except ValueError as e:
        msg = str(e)
        key = next((k for k in sorted(ours, key=len, reverse=True) if k in msg), CONFIG_KEY)
        return msg, f"vllm_xargs.{key}"
    return None


class VTokenRequestCheck:
    """ASGI middleware: a POST whose JSON body has invalid ``vllm_xargs`` ``vtoken*`` keys (or ``vtoken*`` keys
    at its top level, where vLLM would drop them) is answered 400
    (vLLM's error body: ``{"error": {"message", "type", "param", "code"}}``) before vLLM sees it; every
    other request, and the body of a valid one, passes through unchanged."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope.get("type") != "http" or scope.get("method") != "POST":
            await self.app(scope, receive, send)
            return
        messages, body = [], b""
        while True:
            msg = await receive()
            messages.append(msg)
            if msg.get("type") != "http.request":
                break
            body += msg.get("body", b"")
            if not msg.get("more_body", False):
                break
        error = None
        if b"vtoken" in body:
            try:
                error = http_options_error(json.loads(body))
            except (ValueError, RecursionError):  # not JSON: vLLM answers it
                error = None
        if error is not None:
            counters().rejected.inc()
            await _send_400(send, *error)
            return

        async def replay() -> Any:
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)


async def _send_400(send: Any, message: str, param: str) -> None:
    payload = json.dumps({"error": {"message": message, "type": "Bad Request", "param": param,
                                    "code": 400}}).encode()
    await send({"type": "http.response.start", "status": 400,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]})
    await send({"type": "http.response.body", "body": payload})
