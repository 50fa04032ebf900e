"""Data-parallel serving: ``vtoken-cli serve MODEL --policy h2o --data-parallel-size 2`` on CPU.

vLLM runs one engine core (scheduler + worker) per data-parallel rank behind one API server and its DP
coordinator; each engine core loads the plugin's scheduler and worker on its own, so eviction and its block
accounting are per rank and a request lives on one rank from admission to finish. Checked through the real
server with the ``openai`` client and raw HTTP:

- both ranks serve (vLLM's ``engine``-labelled counters), and every request gets, among concurrent
  requests spread over both ranks, the output it gets alone (fp32: batch-invariant numerics, as in
  ``test_openai_server``), per-request options (``vtoken_enabled``, ``vtoken_budget_tokens``,
  ``vtoken_pinned_spans``) included;
- an opted-out request evicts nothing and a default one evicts (``vtoken_evictions_total`` deltas, the sum
  over both engine cores);
- the block-pool gauges add up over the ranks: ``vtoken_kv_blocks_total`` is both pools' usable blocks and
  every block is free again when the requests are done (with ``multiprocess_mode="mostrecent"`` the gauges
  showed whichever rank wrote last: half the pool).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.vllm._server import Server, _get, _post, running_server

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

BLOCKS = 64  # per rank
WORDS = ("river stone lantern orchard violet copper meadow harbor falcon ember willow quartz thistle beacon "
         "saffron glacier").split()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    from vtoken_bench.models import smollm2_path
    from vtoken_bench.serve_engine import kv_bytes

    with running_server(tmp_path_factory.mktemp("dp") / "server.log",
                        ["--policy", "h2o", "--eviction-ratio", "0.5", "--max-model-len", "1024",
                         "--max-num-seqs", "4", "--block-size", "32", "--enforce-eager", "--dtype", "float32",
                         "--kv-cache-memory-bytes", str(kv_bytes(str(smollm2_path()), BLOCKS, 32)),
                         "--data-parallel-size", "2"]) as srv:
        yield srv


def _prompt(n_words: int, seed: int) -> str:
    return " ".join(WORDS[(i * 7 + seed * 3 + i // 5) % len(WORDS)] for i in range(n_words))


def _per_engine(srv: Server, name: str) -> dict[str, float]:
    """``{engine label: value}`` of one of vLLM's engine-labelled series on ``/metrics``."""
    _, text = _get(srv.base + "/metrics")
    out: dict[str, float] = {}
    for labels, value in re.findall(rf"^{re.escape(name)}\{{([^}}]*)\}} ([0-9.eE+-]+)$", text, re.M):
        m = re.search(r'engine="(\d+)"', labels)
        if m:
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(value)
    return out


# (prompt words, seed, vllm_xargs): the default policy, opted out, a per-request budget, pinned spans
CASES = [(180, 0, None), (220, 1, {"vtoken_enabled": False}), (200, 2, {"vtoken_budget_tokens": 64}),
         (240, 3, {"vtoken_pinned_spans": [0, 16]}), (190, 4, None), (230, 5, {"vtoken_budget_tokens": 96}),
         (210, 6, None), (250, 7, {"vtoken_enabled": False})]


def _run(srv: Server, case: tuple[int, int, dict | None]) -> str:
    n, seed, xargs = case
    body: dict = {"model": srv.model, "prompt": _prompt(n, seed), "max_tokens": 24, "temperature": 0,
                  "ignore_eos": True}
    if xargs is not None:
        body["vllm_xargs"] = xargs
    code, out = _post(srv.base + "/v1/completions", body)
    assert code == 200, out
    return out["choices"][0]["text"]


def test_pool_gauges_add_up_over_the_ranks(server: Server) -> None:
    """Before any request: each rank's pool is BLOCKS less vLLM's null block, all free, none held."""
    assert server.metric("vtoken_kv_blocks_total") == 2 * (BLOCKS - 1)
    assert server.metric("vtoken_kv_blocks_free") == 2 * (BLOCKS - 1)
    assert server.metric("vtoken_kv_blocks_held") == 0


def test_options_and_eviction_per_request_on_either_rank(server: Server) -> None:
    before = server.metric("vtoken_evictions_total")
    _run(server, CASES[1])  # opted out: no eviction on whichever rank served it
    assert server.metric("vtoken_evictions_total") == before
    _run(server, CASES[0])  # the server's policy: the prompt is over twice its budget, it evicts
    assert server.metric("vtoken_evictions_total") > before


def test_concurrent_requests_over_both_ranks_get_their_own_output(server: Server) -> None:
    alone = [_run(server, c) for c in CASES]
    served = _per_engine(server, "vllm:request_success_total")
    with ThreadPoolExecutor(len(CASES)) as ex:
        together = list(ex.map(lambda c: _run(server, c), CASES * 2))
    after = _per_engine(server, "vllm:request_success_total")
    assert sorted(after) == ["0", "1"], after
    assert all(after[e] > served.get(e, 0.0) for e in after), (served, after)  # both ranks served the batch
    assert together == alone * 2
    # every block back in both pools
    assert server.metric("vtoken_kv_blocks_held") == 0
    assert server.metric("vtoken_kv_blocks_free") == server.metric("vtoken_kv_blocks_total") == 2 * (BLOCKS - 1)
    assert _post(server.base + "/v1/completions", {"model": server.model, "prompt": "hello", "max_tokens": 4})[0] == 200
