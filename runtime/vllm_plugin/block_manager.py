"""The one owner of each request's vLLM block list under eviction: vLLM's full-attention manager, by cache length.

vLLM's scheduler sizes a request's KV blocks from its TRUE length (``request.num_computed_tokens`` plus the
step's new tokens), which also drives positions, stop checks and ``max_model_len`` and never changes here. Under
eviction the request holds fewer tokens than that::

    evicted       = true length - cache length        (learnt from the worker's report; kept across steps)
    blocks held   = cdiv(true length - evicted, block_size)

:class:`EvictingAttentionManager` is vLLM's ``FullAttentionManager`` (the ``SingleTypeKVCacheManager`` that holds
``req_to_blocks``, the request's block list) plus the request's ``evicted`` count. It is the only code that
changes a block list:

    get_num_blocks_to_allocate,    allocation by cache length: vLLM asks with the true length, the manager
    allocate_new_blocks            subtracts ``evicted``; ``request.num_computed_tokens`` is never touched
    admission (full sequence)      a waiting request needs ``cdiv(min(its length, peak), block_size)`` free
                                   blocks, ``peak`` from the scheduler's rule (:meth:`bind_admission`)
    truncate(rid, Truncation)      the worker's report: records ``evicted``, frees the tail blocks beyond
                                   ``cdiv(cache length, block_size)`` tail first, and marks the row to resend
    pop_blocks_for_free            finish and preemption (recompute) forget ``evicted`` with the blocks
    cache_blocks (prefix caching)  vLLM's offer of full blocks to the prefix cache, held back to the
                                   frozen prefix for requests that may evict (:mod:`.prefix`): a block is
                                   offered once the output of the step that computed it has arrived
                                   (:meth:`step_scheduled` / :meth:`step_done`) and only below the request's
                                   first evicted position; what is left to offer is offered when the request
                                   finishes or is preempted

The pool's accounting is published as gauges (``vtoken_kv_blocks_total`` / ``_free`` / ``_held``, see
:mod:`.metrics`) at start-up and after every allocation, tail free and request free: :meth:`pool_accounts`.

Blocks freed that stay freed. ``blocks_freed`` counts every tail block ``truncate`` gives back; a block freed
at one step and allocated to the same request at its next allocation (its next scheduled step) was only
lent to the pool: with a budget of whole blocks and slack 0 a decoding request takes a block and gives it
back at every step. ``blocks_kept_freed`` (and ``vtoken_blocks_freed_total``) counts a freed block only when
it stays freed: the blocks freed since the request's last allocation, less the blocks that allocation
takes (settled at that allocation, or all of them when the request finishes or is preempted).

The runner's copy of a truncated row follows through the scheduler output: the next one that schedules the request
carries its whole block list (:meth:`rows_to_resend`; ``SchedulerOutput.vtoken_rows``, :mod:`.report`) and the
runner replaces its row in place. (Sending it the way a resumed request's is sent, as this plugin once did, breaks
under asynchronous scheduling: vLLM's runner then rebuilds the request's output tokens from the scheduler's copy,
which lacks the tokens still in flight.) A report names the true length its cache length refers to, so a report
that arrives a step late (asynchronous scheduling, pipeline parallelism) still gives the right count.

vLLM builds this manager itself: the vToken scheduler gives its KV cache group the role :data:`VTOKEN_ROLE`
and registers this class for that role (``KVCacheSpecRegistry.register_role_manager``, vLLM's registration
point for managers), see :func:`register`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager
from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

from vtoken_runtime.token_table import cdiv

from .metrics import counters, record_pool
from .prefix import NEVER, frozen_tokens
from .report import Truncation

VTOKEN_ROLE = "vtoken"  # the role the vToken scheduler gives the full-attention KV cache group (.kv_groups)


class EvictingAttentionManager(FullAttentionManager):
    """vLLM's full-attention manager allocating by cache length and freeing tail blocks after eviction."""

    def __init__(self, kv_cache_spec: Any, **kwargs: Any) -> None:
        if not isinstance(kv_cache_spec, FullAttentionSpec) or getattr(kv_cache_spec, "sliding_window", None):
            raise ValueError(f"vtoken: only full-attention KV cache groups are supported, got "
                             f"{type(kv_cache_spec).__name__}")
        super().__init__(kv_cache_spec, **kwargs)
        self._evicted: dict[str, int] = {}
        self._resend: set[str] = set()
        self._admission: Callable[[str, int], int] | None = None
        self._may_evict: Callable[[Any], bool] | None = None  # bound with prefix caching on (bind_prefix_rule)
        self._intact: dict[str, int] = {}  # first evicted position (prefix caching on)
        self._offering: dict[str, tuple[Any, dict[str, Any]]] = {}  # request, cache_blocks kwargs: offered at free
        self.blocks_freed = 0  # every block truncate freed
        self.blocks_kept_freed = 0  # of those, the ones not taken back by the request's next allocation
        self._lent: dict[str, int] = {}  # blocks freed since the request's last allocation
        self._siblings: list[Any] = []  # a hybrid model's other groups' managers (bind_siblings)
        self._in_flight: list[tuple[Any, dict[str, int]]] = []  # (scheduler output, its tokens per request)
        counters()  # the vtoken_* counters exist (at 0) from start-up
        self._record_pool()  # and the block-pool gauges, at the empty pool's figures

    def bind_admission(self, peak_tokens: Callable[[str, int], int]) -> None:
        """``peak_tokens(request_id, frozen)``: the most tokens the request will hold while it (re)prefills with
        its first ``frozen`` tokens from the prefix cache (the scheduler's
        :meth:`~.scheduler.VTokenScheduler.admission_tokens`); admission asks for that many."""
        self._admission = peak_tokens

    def bind_prefix_rule(self, may_evict: Callable[[Any], bool]) -> None:
        """Prefix caching is on: a request for which ``may_evict(request)`` holds offers its blocks to the prefix
        cache by the frozen-prefix rule (:mod:`.prefix`), the others as vLLM does."""
        self._may_evict = may_evict

    # ------------------------------------------------------------------ queries
    def evicted_tokens(self, request_id: str) -> int:
        """Tokens of the request no longer in the cache (its true length minus its cache length)."""
        return self._evicted.get(request_id, 0)

    def held_blocks(self, request_id: str) -> int:
        return len(self.req_to_blocks.get(request_id, ()))

    def bind_siblings(self, managers: Sequence[Any]) -> None:
        """A hybrid model (:mod:`.kv_groups`): vLLM's managers of the other KV cache groups, which draw on the same
        block pool; :meth:`pool_accounts` counts their blocks as held too."""
        self._siblings = list(managers)

    def pool_accounts(self) -> tuple[int, int, int]:
        """``(total, free, held)``: the pool's usable blocks (its null block excluded), its own free count, and the
        blocks on the request lists of this manager and of its siblings (a hybrid model's sliding-window groups,
        whose lists hold vLLM's null block for blocks past the window: not counted). ``free + held == total``
        between scheduler steps."""
        total = self.block_pool.num_gpu_blocks - 1
        held = sum(len(b) for b in self.req_to_blocks.values())
        held += sum(1 for m in self._siblings for bl in m.req_to_blocks.values() for b in bl if not b.is_null)
        return total, self.block_pool.get_num_free_blocks(), held

    def _record_pool(self) -> None:
        record_pool(*self.pool_accounts())

    def admission_blocks(self, request_id: str, num_tokens: int, frozen: int = 0) -> int:
        """Blocks a waiting request of ``num_tokens`` tokens must hold (its ``frozen`` first tokens from the prefix
        cache included): ``cdiv(min(num_tokens, peak), block_size)``, where ``peak`` bounds what it will hold
        (all of it without a bound)."""
        peak = self._admission(request_id, frozen) if self._admission is not None else num_tokens
        return cdiv(min(int(num_tokens), int(peak)), self.block_size)

    # ------------------------------------------------------------------ vLLM's allocation, by cache length
    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int, new_computed_blocks: Sequence[Any],
                                   total_computed_tokens: int, num_local_computed_tokens: int,
                                   num_tokens_main_model: int, apply_admission_cap: bool = False,
                                   prefill_end: int = 0) -> int:
        ev = self._evicted.get(request_id, 0)
        n = super().get_num_blocks_to_allocate(request_id, num_tokens - ev, new_computed_blocks,
                                               total_computed_tokens - ev, num_local_computed_tokens - ev,
                                               num_tokens_main_model - ev, prefill_end=prefill_end)
        if apply_admission_cap:  # the full-sequence admission gate (never a per-step allocation)
            # n = new blocks + prefix-cache hits still in the free queue (taken from it on allocation); the
            # cap bounds the new ones: what the request will hold less what it holds and the hits
            hits = list(new_computed_blocks)
            frozen = int(total_computed_tokens) // self.block_size * self.block_size if hits else 0
            taken = self._get_num_evictable_blocks(hits) if hits else 0
            have = self.held_blocks(request_id) + len(hits)
            return max(min(n - taken, self.admission_blocks(request_id, num_tokens - ev, frozen) - have), 0) + taken
        return n

    def allocate_new_blocks(self, request_id: str, num_tokens: int, num_tokens_main_model: int) -> list[Any]:
        ev = self._evicted.get(request_id, 0)
        new = super().allocate_new_blocks(request_id, num_tokens - ev, num_tokens_main_model - ev)
        self._settle(request_id, len(new))
        self._record_pool()
        return new

    def free(self, request_id: str) -> None:
        super().free(request_id)
        self._record_pool()

    def pop_blocks_for_free(self, request_id: str) -> list[Any]:
        self._settle(request_id, 0)
        offering = self._offering.pop(request_id, None)
        if offering is not None and request_id in self.req_to_blocks:  # finish / preemption: the last steps' blocks
            req, kw = offering
            super().cache_blocks(req, self._offerable(req), **kw)
        self._evicted.pop(request_id, None)
        self._intact.pop(request_id, None)
        self._resend.discard(request_id)
        return super().pop_blocks_for_free(request_id)

    # ------------------------------------------------------------------ prefix caching
    def step_scheduled(self, scheduler_output: Any) -> None:
        """A step was scheduled: its tokens are in flight until :meth:`step_done` of the same output."""
        self._in_flight.append((scheduler_output, dict(scheduler_output.num_scheduled_tokens)))

    def step_done(self, scheduler_output: Any) -> None:
        """The step's output (and its eviction report) has arrived."""
        self._in_flight = [(so, n) for so, n in self._in_flight if so is not scheduler_output]

    def in_flight_tokens(self, request_id: str) -> int:
        """The request's tokens in steps scheduled whose output has not arrived (0 with synchronous scheduling
        when the scheduler schedules; asynchronous scheduling and pipeline parallelism keep steps in flight)."""
        return sum(n.get(request_id, 0) for _, n in self._in_flight)

    def _offerable(self, request: Any) -> int:
        """Tokens of the request's frozen prefix (:func:`~.prefix.frozen_tokens`): its blocks computed before
        the oldest step whose output has not arrived, below its first evicted position. vLLM counts a step's
        tokens when it schedules it (``num_computed_tokens``); with steps in flight the worker may still evict in
        blocks computed by them, and the first evicted position known here is the one reported before them, so
        the tokens in flight are not counted: the worker freezes exactly this prefix at the oldest step in flight
        (the same two numbers), which is what keeps an offered block from being evicted in."""
        done = int(request.num_computed_tokens) - self.in_flight_tokens(request.request_id)
        return frozen_tokens(max(done, 0), self._intact.get(request.request_id, NEVER), self.block_size)

    def cache_blocks(self, request: Any, num_tokens: int, retention_interval: int | None = None, *,
                     replay_boundaries: Sequence[int]) -> None:
        """vLLM's offer of the request's full blocks to the prefix cache; for a request that may evict, only
        its frozen prefix (a block offered is then never evicted in, never moved, never freed by a truncation:
        the worker pins the same prefix before it evicts)."""
        kw: dict[str, Any] = {"retention_interval": retention_interval, "replay_boundaries": replay_boundaries}
        if self._may_evict is not None and self._may_evict(request):
            self._offering[request.request_id] = (request, kw)
            num_tokens = min(int(num_tokens), self._offerable(request))
        super().cache_blocks(request, num_tokens, **kw)

    def intact_prefix(self, request_id: str) -> int:
        """The request's first evicted position as the worker reported it (:data:`~.prefix.NEVER`: none)."""
        return self._intact.get(request_id, NEVER)

    # ------------------------------------------------------------------ eviction
    def truncate(self, request_id: str, t: Truncation, computed: int | None = None) -> int:
        """The worker evicted: the request now holds ``t.cache_len`` of ``t.true_len`` tokens. Records the
        evicted count and frees the tail blocks beyond what it holds (tail first, as vLLM frees). Returns the
        blocks freed; a request this manager no longer holds (finished or preempted since the report was made)
        is ignored (0).

        ``computed``: the request's ``num_computed_tokens`` now. vLLM counts a step's tokens when it schedules
        them, so with more than one batch in flight (pipeline parallelism: the next prefill chunk is scheduled
        before this report arrives) the request already has ``computed - t.true_len`` more tokens on the worker,
        written after ``t.cache_len`` in the blocks that follow::

            blocks kept = cdiv(t.cache_len + max(computed - t.true_len, 0), block_size)

        (``computed == t.true_len`` when the report comes before the next ``schedule()``)."""
        blocks = self.req_to_blocks.get(request_id)
        if blocks is None:
            return 0
        if not 0 <= t.cache_len <= t.true_len:
            raise RuntimeError(f"vtoken: request {request_id} reports cache length {t.cache_len} for true "
                               f"length {t.true_len}")
        ahead = max(int(computed) - int(t.true_len), 0) if computed is not None else 0
        keep = cdiv(int(t.cache_len) + ahead, self.block_size)
        if keep < self.num_cached_block.get(request_id, 0):  # the worker froze what was offered: it cannot be
            raise RuntimeError(f"vtoken: request {request_id} reports cache length {t.cache_len}, which would free "
                               f"blocks offered to the prefix cache ({self.num_cached_block[request_id]})")
        self._evicted[request_id] = int(t.true_len) - int(t.cache_len)
        if t.intact >= 0 or t.cache_len < t.true_len:  # unknown (-1) after an eviction: nothing offerable
            self._intact[request_id] = min(self._intact.get(request_id, NEVER), max(int(t.intact), 0))
        if len(blocks) <= keep:
            return 0
        tail = blocks[keep:]
        del blocks[keep:]
        self.block_pool.free_blocks(reversed(tail))
        self._resend.add(request_id)
        self.blocks_freed += len(tail)
        self._lent[request_id] = self._lent.get(request_id, 0) + len(tail)
        self._record_pool()
        return len(tail)

    def _settle(self, request_id: str, allocated: int) -> None:
        """The request allocates ``allocated`` blocks: that many of the blocks it freed since its last
        allocation were lent, the rest stay freed (counted)."""
        lent = self._lent.pop(request_id, 0)
        kept = lent - min(lent, allocated)
        if kept:
            self.blocks_kept_freed += kept
            counters().blocks_freed.inc(kept)

    def rows_to_resend(self, scheduled: Iterable[str]) -> set[str]:
        """The requests among ``scheduled`` whose block list shrank since it was last sent to the runner
        (forgotten here: the caller sends them now)."""
        out = self._resend.intersection(scheduled)
        self._resend -= out
        return out


def register() -> None:
    """Select :class:`EvictingAttentionManager` for KV cache groups with role :data:`VTOKEN_ROLE` (idempotent;
    other groups, and other engines in the process, keep vLLM's managers)."""
    KVCacheSpecRegistry.register_role_manager(VTOKEN_ROLE, EvictingAttentionManager)
