"""Request admission: per-request options are validated in vLLM's frontend, before scheduling.

vLLM 0.32 runs ``validate_params(sampling_params)`` of every custom logits processor when a request
is admitted (``InputProcessor``, in the API-server process or in ``LLM.generate``'s process); a
ValueError there becomes an HTTP 400 naming the problem, or a ValueError from ``LLM.generate`` for
that request. :class:`VTokenOptions` is such a processor whose only job is that hook: it never changes
logits (argmax invariant, so vLLM skips it on the sampling path). ``vllm_engine_args`` /
``vtoken-cli serve`` register it as ``vtoken_runtime.vllm_plugin.frontend:VTokenOptions``.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor

from .config import request_options
from .metrics import counters

FQCN = "vtoken_runtime.vllm_plugin.frontend:VTokenOptions"


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
