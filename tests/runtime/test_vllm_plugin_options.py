"""Per-request options of the vLLM plugin (``runtime/vllm_plugin/config.py``, no vLLM needed): the parser
takes any JSON value for every key and either returns options that mean what was asked or raises a
ValueError naming the key; it never raises anything else (a TypeError would escape vLLM's 400 path)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vtoken_runtime.vllm_plugin.config import (
    FLAT_KEYS,
    PluginConfig,
    RequestOptions,
    parse_request_options,
)

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=True) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)
keys = st.sampled_from([*FLAT_KEYS, "vtoken", "vtoken_other", "vtokenx", "other", "session_id"])


@settings(max_examples=600, deadline=None)
@given(st.dictionaries(keys, json_values, max_size=4))
def test_any_json_value_is_parsed_or_refused_with_a_value_error(extra: dict) -> None:
    try:
        o = parse_request_options(extra)
    except ValueError as e:
        assert str(e).startswith("vtoken: ")
        return
    assert isinstance(o, RequestOptions)
    assert isinstance(o.enabled, bool)
    assert o.budget_tokens is None or (isinstance(o.budget_tokens, int) and o.budget_tokens >= 1)
    assert o.eviction_ratio is None or 0.0 <= o.eviction_ratio < 1.0
    assert not (o.budget_tokens is not None and o.eviction_ratio is not None)
    assert all(isinstance(a, int) and isinstance(b, int) and 0 <= a <= b for a, b in o.pinned_spans)
    assert o.allocation in ("policy", "uniform")


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 10**6)).map(sorted), max_size=8),
       st.integers(0, 10**6))
def test_spans_are_flat_pairs_and_clipped_to_the_request(spans: list, length: int) -> None:
    flat = [x for s in spans for x in s]
    o = parse_request_options({"vtoken_pinned_spans": flat})
    assert o.pinned_spans == tuple(tuple(s) for s in spans)
    nested = parse_request_options({"vtoken": {"pinned_spans": [list(s) for s in spans]}})
    assert nested.pinned_spans == o.pinned_spans
    clipped = o.clipped_spans(length)
    assert all(0 <= a < b <= length for a, b in clipped)
    covered = {p for a, b in spans for p in range(a, min(b, length))} if length < 10**4 else None
    if covered is not None:
        assert {p for a, b in clipped for p in range(a, b)} == covered


@pytest.mark.parametrize("extra, want", [
    ({}, RequestOptions()),
    (None, RequestOptions()),
    ({"vtoken_enabled": False}, RequestOptions(enabled=False)),
    ({"vtoken_enabled": 0}, RequestOptions(enabled=False)),  # JSON false over HTTP arrives as 0
    ({"vtoken_enabled": 1, "vtoken_budget_tokens": 64}, RequestOptions(budget_tokens=64)),
    ({"vtoken_eviction_ratio": 0.25}, RequestOptions(eviction_ratio=0.25)),
    ({"vtoken_budget_tokens": 32.0}, RequestOptions(budget_tokens=32)),
    ({"vtoken": False}, RequestOptions(enabled=False)),
    ({"vtoken": {"budget_tokens": 16, "pinned_spans": [[0, 4]]}}, RequestOptions(budget_tokens=16, pinned_spans=((0, 4),))),
    ({"session_id": "abc", "other": 1}, RequestOptions()),  # not ours: left alone
    ({"vtoken_allocation": "uniform"}, RequestOptions(allocation="uniform")),
    ({"vtoken": {"allocation": "policy"}}, RequestOptions()),
])
def test_known_values(extra: dict, want: RequestOptions) -> None:
    assert parse_request_options(extra) == want


@pytest.mark.parametrize("extra, key", [
    ({"vtoken_allocation": "adaptive"}, "vtoken_allocation must be one of"),
    ({"vtoken_allocation": 1}, "vtoken_allocation"),
    ({"vtoken_enabled": "false"}, "vtoken_enabled"),
    ({"vtoken_budget_tokens": True}, "vtoken_budget_tokens"),
    ({"vtoken_budget_tokens": 0}, "vtoken_budget_tokens"),
    ({"vtoken_eviction_ratio": 1.0}, "vtoken_eviction_ratio"),
    ({"vtoken_eviction_ratio": float("nan")}, "vtoken_eviction_ratio"),
    ({"vtoken_pinned_spans": [0, 16, 32]}, "vtoken_pinned_spans"),
    ({"vtoken_pinned_spans": [[0, 16]]}, "vtoken_pinned_spans"),  # nested pairs: the nested alias only
    ({"vtoken_pinned_spans": [5, 1]}, "start <= end"),
    ({"vtoken_pinned_spans": [-1, 4]}, "vtoken_pinned_spans"),
    ({"vtoken_budget": 4}, "vtoken_budget"),
    ({"vtoken": {"budget": 4}}, "vtoken.budget"),
    ({"vtoken": {"budget_tokens": 4}, "vtoken_budget_tokens": 4}, "both flat and nested"),
])
def test_invalid_values_name_the_key(extra: dict, key: str) -> None:
    with pytest.raises(ValueError, match=key):
        parse_request_options(extra)


def test_engine_config_accepts_a_policy_name_and_names_bad_settings() -> None:
    class V:
        additional_config = {"vtoken": "h2o"}

    assert PluginConfig.from_vllm_config(V()).policy == "h2o"
    V.additional_config = {"vtoken": {"policy": "h2o", "ratio": 0.5}}
    with pytest.raises(ValueError, match=r"unknown setting\(s\) \['ratio'\]"):
        PluginConfig.from_vllm_config(V())
    V.additional_config = {"vtoken": 3}
    with pytest.raises(ValueError, match="policy name or a mapping"):
        PluginConfig.from_vllm_config(V())
    # slack follows vtoken_sdk.budget.parse_slack (the CLI's rule): "block" or tokens, JSON strings of digits too
    assert [PluginConfig(policy="h2o", slack=x).slack for x in ("block", 0, 32, "32")] == ["block", 0, 32, 32]
    for bad in (-1, 1.5, True, "blocks", ""):
        with pytest.raises(ValueError, match=r"^vtoken: slack: got"):
            PluginConfig(policy="h2o", slack=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("v", [float("inf"), float("-inf"), float("nan"), 2**80, 1e300])
def test_non_finite_and_huge_numbers_are_value_errors(v: float) -> None:
    for key in ("vtoken_budget_tokens", "vtoken_eviction_ratio"):
        with pytest.raises(ValueError, match=key):
            parse_request_options({key: v})
    with pytest.raises(ValueError, match="vtoken_pinned_spans"):
        parse_request_options({"vtoken_pinned_spans": [0, v]})


@pytest.mark.parametrize("extra, line", [
    ({"vtoken_pinned_spans": [[0, 16]]},
     "vtoken_pinned_spans: got a nested list [[0, 16]]; expected a flat list of start,end pairs, e.g. [0, 16, 32, 40]"),
    ({"vtoken_pinned_spans": [0, 16, [32, 40]]}, "vtoken_pinned_spans: got a nested list"),
    ({"vtoken_pinned_spans": [-1, 16]}, "vtoken_pinned_spans: span start -1 in [-1, 16] must be an integer >= 0; "
                                        "expected a flat list"),
    ({"vtoken_pinned_spans": [0, 2.5]}, "vtoken_pinned_spans: span end 2.5 in [0, 2.5] must be an integer >= 0"),
])
def test_span_errors_are_one_line_with_the_accepted_form(extra: dict, line: str) -> None:
    with pytest.raises(ValueError) as e:
        parse_request_options(extra)
    assert line in str(e.value) and "\n" not in str(e.value)


def test_the_serving_slack_is_block_unless_the_policy_or_the_configuration_sets_one(monkeypatch) -> None:  # noqa: ANN001
    from vtoken_runtime.vllm_plugin import config
    from vtoken_sdk.budget import Budget

    assert config.SERVING_SLACK == "block"
    assert PluginConfig(policy="h2o").load_policy().budget.slack == "block"
    assert PluginConfig(policy="h2o", eviction_ratio=0.3).load_policy().budget.slack == "block"
    assert PluginConfig(policy="h2o", slack=0).load_policy().budget.slack == 0
    assert PluginConfig(policy="h2o", slack=32).load_policy().budget.slack == 32
    own = config._load_policy("h2o", None)
    own = own.configure(budget=Budget(ratio=0.5, slack=64))
    monkeypatch.setattr(config, "_load_policy", lambda spec, name: own)
    assert PluginConfig(policy="mine").load_policy().budget.slack == 64  # the policy's own slack stays
    assert PluginConfig(policy="mine", slack="block").load_policy().budget.slack == "block"


def test_a_policy_with_unequal_budgets_loads_and_one_evicting_during_decode_is_refused_with_the_reason() -> None:
    pol = PluginConfig(policy="ada_snapkv").load_policy()  # per-row pages in the CPU worker (issue 39)
    assert not pol.spec.uniform and pol.budget.when == "prefill"
    with pytest.raises(ValueError, match="vtoken: policy 'ada_snapkv' has allocation=AdaptiveLayer.*when='decode'"):
        PluginConfig(policy="ada_snapkv", when="decode").load_policy()


def test_http_check_names_the_path_and_refuses_options_at_the_top_level_of_the_body() -> None:
    """vLLM drops body fields it does not know without a word: ``vtoken_*`` at the top level (instead of inside
    ``vllm_xargs``) would silently do nothing, so the HTTP check refuses it, naming where it goes."""
    from vtoken_runtime.vllm_plugin.frontend import http_options_error

    msg, param = http_options_error({"prompt": "x", "vtoken_budget_tokens": 8})
    assert param == "vtoken_budget_tokens" and "inside vllm_xargs" in msg and "\n" not in msg
    assert http_options_error({"vllm_xargs": {"vtoken_budget_tokens": 0}})[1] == "vllm_xargs.vtoken_budget_tokens"
    assert http_options_error({"vllm_xargs": {"vtoken": {}}})[1] == "vllm_xargs.vtoken"
    for fine in ({"vllm_xargs": {"vtoken_budget_tokens": 8}}, {"prompt": "vtoken_budget_tokens"}, [1], "x",
                 {"vllm_xargs": "vtoken"}):
        assert http_options_error(fine) is None
