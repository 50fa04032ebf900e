"""The serving surface as a user meets it: ``vtoken-cli serve`` starts vLLM's OpenAI server (its own
engine-core process), driven with the ``openai`` client and raw HTTP.

One server for the module (SmolLM2-135M, a small KV cache: 96 blocks of 32 tokens), stopped by the
fixture. Checked: every ``vtoken_*`` counter is on ``/metrics`` at 0 before the first request; completions
and chat, streaming and not; per-request options over ``vllm_xargs`` (eviction seen on ``/metrics``); every
invalid option is a 400 naming the key (one line, with the accepted form; streamed requests too, before the
stream starts; counted in ``vtoken_rejected_requests_total``) while the server keeps serving; 20 concurrent requests all complete with the output they get alone; a client that
disconnects mid-stream gives its blocks back; refused configurations exit 2 at once; a second server at
the default dtype (bf16) serving a long prompt with eviction; and a third serving a policy with unequal
budgets (AdaKV, per-row pages) to concurrent clients.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.vllm._server import CLI, Server, _get, _post, running_server
from vtoken_bench.soak_mix import BAD as SOAK_BAD

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

BLOCKS = 96


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    from vtoken_bench.models import smollm2_path
    from vtoken_bench.serve_engine import kv_bytes

    # fp32: the twenty-requests test compares batched with alone outputs, which only batch-invariant numerics
    # allow (vanilla vLLM in bf16 gives other greedy tokens in a batch: 3 of 4 prompts measured)
    with running_server(tmp_path_factory.mktemp("server") / "server.log",
                         ["--policy", "h2o", "--eviction-ratio", "0.5", "--max-model-len", "1024",
                          "--max-num-seqs", "8", "--block-size", "32", "--enforce-eager", "--dtype", "float32",
                          "--kv-cache-memory-bytes", str(kv_bytes(str(smollm2_path()), BLOCKS, 32))]) as srv:
        yield srv


def _prompt(n_words: int, seed: int = 0) -> str:
    words = ("river stone lantern orchard violet copper meadow harbor falcon ember willow quartz "
             "thistle beacon saffron glacier").split()
    return " ".join(words[(i * 7 + seed * 3) % len(words)] for i in range(n_words))


COUNTERS = ("tokens_evicted", "blocks_freed", "tokens_moved", "evictions", "policy_failures", "rejected_requests",
            "reclaim_seconds", "policy_seconds")


def test_every_vtoken_counter_is_listed_at_zero_before_the_first_request(server: Server) -> None:
    """The first test of the module: the server has served nothing yet."""
    _, text = _get(server.base + "/metrics")
    assert server.metric("vllm:request_success_total") == 0
    for name in COUNTERS:
        found = re.findall(rf"^vtoken_{name}_total(?:\{{[^}}]*\}})? ([0-9.eE+-]+)$", text, re.M)
        assert found and all(float(v) == 0 for v in found), (name, found)


def test_startup_line_and_completion_chat_streaming(server: Server) -> None:
    assert re.search(r"vtoken: policy=h2o budget\(eviction_ratio=0\.5.*granularity=head statistics=\['attn_sum'\]",
                     server.log.read_text())
    c = server.client()
    r = c.completions.create(model=server.model, prompt=_prompt(40), max_tokens=12, temperature=0)
    assert r.choices[0].text and r.usage.completion_tokens == 12
    chunks = list(c.completions.create(model=server.model, prompt=_prompt(40), max_tokens=12, temperature=0,
                                       stream=True))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == r.choices[0].text
    chat = c.chat.completions.create(model=server.model, messages=[{"role": "user", "content": "Say hello."}],
                                     max_tokens=8, temperature=0)
    assert chat.choices[0].message.content
    sc = c.chat.completions.create(model=server.model, messages=[{"role": "user", "content": "Say hello."}],
                                   max_tokens=8, temperature=0, stream=True)
    assert "".join(ch.choices[0].delta.content or "" for ch in sc if ch.choices) == chat.choices[0].message.content


def test_per_request_options_over_http_evict_and_show_on_metrics(server: Server) -> None:
    before = server.metric("vtoken_tokens_evicted_total")
    freed = server.metric("vtoken_blocks_freed_total")
    url = server.base + "/v1/completions"
    base = {"model": server.model, "prompt": _prompt(300, 1), "max_tokens": 8, "temperature": 0}
    code, off = _post(url, {**base, "vllm_xargs": {"vtoken_enabled": False}})
    assert code == 200 and server.metric("vtoken_tokens_evicted_total") == before  # opted out: nothing evicted
    # another prompt: the opted-out request's blocks are in the prefix cache (prefix caching is on by default),
    # and a request hitting them keeps its cached prefix (vtoken_runtime.vllm_plugin.prefix)
    code, on = _post(url, {**base, "prompt": _prompt(300, 2),
                           "vllm_xargs": {"vtoken_budget_tokens": 64, "vtoken_pinned_spans": [0, 8]}})
    assert code == 200 and on["choices"][0]["text"]
    assert server.metric("vtoken_tokens_evicted_total") > before
    assert server.metric("vtoken_blocks_freed_total") > freed
    assert server.metric("vtoken_policy_failures_total") == 0


# the soak's invalid options (one list of what a 400 must name) and two more
BAD = [
    *SOAK_BAD,
    ({"vtoken_pinned_spans": "0-16"}, "vtoken_pinned_spans"),
    ({"vtoken_budget_tokens": 8, "vtoken_eviction_ratio": 0.5}, "at most one"),
]


def test_every_invalid_option_is_a_400_and_the_server_keeps_serving(server: Server) -> None:
    url = server.base + "/v1/completions"
    rejected = server.metric("vtoken_rejected_requests_total")
    for xargs, key in BAD:
        code, body = _post(url, {"model": server.model, "prompt": "hello", "max_tokens": 4, "vllm_xargs": xargs})
        assert code == 400, (xargs, body)
        assert key in body["error"]["message"], (xargs, body)
    assert server.metric("vtoken_rejected_requests_total") == rejected + len(BAD)
    code, body = _post(url, {"model": server.model, "prompt": "hello", "max_tokens": 4, "vllm_xargs": {"vtoken": {}}})
    assert code == 400  # the nested alias is not expressible over HTTP (vLLM types vllm_xargs as flat)
    code, body = _post(url, {"model": server.model, "prompt": "hello", "max_tokens": 4,
                             "vllm_xargs": {"vtoken_pinned_spans": [0, 10**12]}})  # clipped to the request
    assert code == 200 and body["choices"][0]["text"]


def _chat(server: Server, **kw: object) -> object:
    return server.client().chat.completions.create(model=server.model, messages=[{"role": "user", "content": "Hi."}],
                                                   max_tokens=4, **kw)


def _completion(server: Server, **kw: object) -> object:
    return server.client().completions.create(model=server.model, prompt="hello", max_tokens=4, **kw)


def test_a_streamed_request_with_an_invalid_option_is_a_400_before_the_stream(server: Server) -> None:
    import openai

    rejected = server.metric("vtoken_rejected_requests_total")
    cases = [({"vtoken_budget_tokens": -5}, "vtoken_budget_tokens"), ({"vtoken_enabled": "no"}, "vtoken_enabled"),
             ({"vtoken_pinned_spans": [[0, 16]]}, "vtoken_pinned_spans")]
    with pytest.raises(openai.BadRequestError) as e:  # vLLM's own invalid parameter, for comparison
        _completion(server, stream=True, extra_body={"max_tokens": -1})
    assert e.value.status_code == 400
    for call in (_completion, _chat):
        for xargs, key in cases:
            with pytest.raises(openai.BadRequestError) as e:
                call(server, stream=True, extra_body={"vllm_xargs": xargs})
            assert e.value.status_code == 400 and key in e.value.message, (call, xargs, e.value.message)
    code, body = _post(server.base + "/v1/completions", {"model": server.model, "prompt": "hello", "max_tokens": 4,
                                                         "stream": True, "vllm_xargs": {"vtoken_budget_tokens": 0}})
    assert code == 400 and "vtoken_budget_tokens" in body["error"]["message"]
    assert server.metric("vtoken_rejected_requests_total") == rejected + 2 * len(cases) + 1
    chunks = list(_completion(server, stream=True, temperature=0, extra_body={"vllm_xargs": {"vtoken_budget_tokens": 8}}))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices)  # a valid streamed request still streams


MALFORMED = [  # values vLLM's request model refuses (pydantic) or that used to name the whole option
    ({"vtoken_pinned_spans": [[0, 16]]}, "vtoken_pinned_spans: got a nested list [[0, 16]]; expected a flat list"),
    ({"vtoken_pinned_spans": [[0, 16], [32, 40]]}, "vtoken_pinned_spans: got a nested list"),
    ({"vtoken": {"budget_tokens": 64}}, "vllm_xargs.vtoken: the nested form"),
    ({"vtoken": {"pinned_spans": [[0, 16]]}, "vtoken_enabled": 1}, "vllm_xargs.vtoken: the nested form"),
    ({"vtoken_pinned_spans": [-1, 16]}, "vtoken_pinned_spans: span start -1 in [-1, 16] must be an integer >= 0"),
    ({"vtoken_budget_tokens": {"tokens": 64}}, "vtoken_budget_tokens must be an integer >= 1"),
]


def test_malformed_options_are_one_line_naming_the_key_and_the_accepted_form(server: Server) -> None:
    import openai

    rejected = server.metric("vtoken_rejected_requests_total")
    for path, extra in (("/v1/completions", {"prompt": "hello"}),
                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi."}]})):
        for xargs, want in MALFORMED:
            code, body = _post(server.base + path, {"model": server.model, "max_tokens": 4, **extra, "vllm_xargs": xargs})
            msg = body["error"]["message"]
            assert code == 400 and want in msg and "\n" not in msg, (path, xargs, body)
            assert "[0, 16, 32, 40]" in msg or "flat keys" in msg or "integer >= 1" in msg, msg
    with pytest.raises(openai.BadRequestError) as e:
        _completion(server, extra_body={"vllm_xargs": {"vtoken": {"enabled": False}}})
    assert e.value.status_code == 400 and "flat keys" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:  # outside vllm_xargs vLLM would drop it without a word
        _completion(server, extra_body={"vtoken_budget_tokens": 8})
    assert e.value.status_code == 400 and "inside vllm_xargs" in e.value.message
    assert server.metric("vtoken_rejected_requests_total") == rejected + 2 * len(MALFORMED) + 2
    code, body = _post(server.base + "/v1/completions", {"model": server.model, "prompt": "hello", "max_tokens": 4,
                                                         "vllm_xargs": {"vtoken_pinned_spans": [0, 16, 32, 40]}})
    assert code == 200 and body["choices"][0]["text"]


def test_twenty_concurrent_requests_complete_with_their_own_output(server: Server) -> None:
    c = server.client()
    prompts = [_prompt(60 + 25 * (i % 5), i) for i in range(20)]

    def run(p: str) -> str:
        return c.completions.create(model=server.model, prompt=p, max_tokens=16, temperature=0).choices[0].text

    alone = [run(p) for p in prompts[:4]]
    with ThreadPoolExecutor(20) as ex:
        together = list(ex.map(run, prompts))
    assert all(together) and len(together) == 20
    assert together[:4] == alone


def test_client_disconnect_mid_stream_returns_its_blocks(server: Server) -> None:
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    body = {"model": server.model, "prompt": _prompt(400, 2), "max_tokens": 500, "temperature": 0, "stream": True,
            "ignore_eos": True}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    assert resp.readline()  # the stream has started: the request holds KV blocks
    assert server.metric("vllm:num_requests_running") >= 1
    conn.close()  # disconnect mid-stream
    deadline = time.monotonic() + 60
    while server.metric("vllm:num_requests_running") > 0 or server.metric("vllm:kv_cache_usage_perc") > 0:
        assert time.monotonic() < deadline, "the aborted request kept its blocks"
        time.sleep(0.5)
    assert _post(server.base + "/v1/completions", {"model": server.model, "prompt": "hello", "max_tokens": 4})[0] == 200


@pytest.mark.parametrize("args, why", [
    (["--policy", "nope"], "neither a shipped policy"),
    (["--mode", "sideways"], "unknown mode"),
    (["--speculative-config", "{}"], "speculative decoding is not supported"),
    (["--slack", "blocks"], "slack: got 'blocks'"),
])
def test_bad_configuration_is_refused_at_once(tmp_path: Path, args: list[str], why: str) -> None:
    t0 = time.monotonic()
    r = subprocess.run([*CLI, "serve", str(tmp_path), *args], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and why in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert time.monotonic() - t0 < 30


def test_default_dtype_serves_a_long_prompt_with_eviction(tmp_path: Path) -> None:
    """The server as a user starts it: no --dtype (vLLM's auto: SmolLM2's bf16). On a CPU with AMX, H2O (reads
    attention statistics only) keeps vLLM's amx attention, the statistics reading its layout in place (said once,
    no switch to the vec kernels); a long prompt is served with tokens evicted, then a malformed request gets a
    400 and the next request is served. ``--slack block`` (evict only when a block would be held past the
    budget's) is the serving setting the benchmark runs."""
    import torch

    with running_server(tmp_path / "server.log", ["--policy", "h2o", "--eviction-ratio", "0.5", "--slack", "block",
                                                   "--max-model-len", "2048", "--enforce-eager"]) as srv:
        text = srv.log.read_text()
        assert "dtype=torch.bfloat16" in text and "slack=block" in text
        if torch.cpu._is_amx_tile_supported():
            assert text.count("reads vLLM's 'amx' KV layout in place") == 1
            assert "attention uses the 'vec' kernels" not in text
        c = srv.client()
        r = c.completions.create(model=srv.model, prompt=_prompt(900), max_tokens=24, temperature=0)
        assert r.usage.prompt_tokens > 900 and r.usage.completion_tokens == 24 and r.choices[0].text
        assert srv.metric("vtoken_tokens_evicted_total") > 400
        assert _post(srv.base + "/v1/completions", {"model": srv.model, "prompt": "hi", "max_tokens": -3})[0] == 400
        r = c.completions.create(model=srv.model, prompt=_prompt(50, 1), max_tokens=8, temperature=0)
        assert r.usage.completion_tokens == 8


def test_a_policy_with_unequal_budgets_serves_over_http(tmp_path: Path) -> None:
    """``vtoken-cli serve MODEL --policy ada_snapkv`` as a user starts it (vLLM's auto dtype: bf16, the engine's own
    KV layout): AdaKV's rows go to per-row pages after the prompt (issue 39). Four concurrent completions with the
    ``openai`` client, one asking for uniform allocation and one opted out over ``vllm_xargs``: all complete,
    three evict (the opted-out one does not), blocks are freed to vLLM's pool, and once they are done the KV
    cache is empty again; a bad ``vtoken_allocation`` is a 400 naming the key."""
    with running_server(tmp_path / "server.log", ["--policy", "ada_snapkv", "--eviction-ratio", "0.5",
                                                   "--max-model-len", "2048", "--enforce-eager"]) as srv:
        c = srv.client()
        extras = [None, None, {"vtoken_allocation": "uniform"}, {"vtoken_enabled": False}]

        def one(i: int) -> object:
            kw = {"extra_body": {"vllm_xargs": extras[i]}} if extras[i] else {}
            return c.completions.create(model=srv.model, prompt=_prompt(600, i), max_tokens=16, temperature=0, **kw)

        with ThreadPoolExecutor(4) as ex:
            outs = list(ex.map(one, range(4)))
        assert all(o.usage.completion_tokens == 16 and o.choices[0].text for o in outs)
        assert srv.metric("vtoken_evictions_total") == 3
        assert srv.metric("vtoken_tokens_evicted_total") > 3 * 30 * 3 * 200  # rows x heads x tokens, roughly half
        assert srv.metric("vtoken_blocks_freed_total") > 0
        assert srv.metric("vtoken_policy_failures_total") == 0
        deadline = time.monotonic() + 30
        while srv.metric("vllm:kv_cache_usage_perc") > 0 and time.monotonic() < deadline:
            time.sleep(0.5)
        assert srv.metric("vllm:kv_cache_usage_perc") == 0
        code, body = _post(srv.base + "/v1/completions", {"model": srv.model, "prompt": "hi", "max_tokens": 4,
                                                          "vllm_xargs": {"vtoken_allocation": "adaptive"}})
        assert code == 400 and "vtoken_allocation" in body["error"]["message"]
