"""The worker's heap trimmer (``vtoken_runtime.vllm_plugin.heap``): when it trims, its switch, and that glibc's
``malloc_trim`` really gives freed holes inside the heap back to the OS."""

from __future__ import annotations

import sys

import pytest

from vtoken_runtime.vllm_plugin.heap import ENV, HeapTrimmer, _glibc_trim, interval_from_env


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_trims_only_when_a_request_finished_and_the_interval_passed() -> None:
    calls: list[int] = []
    clock = Clock()
    h = HeapTrimmer(interval_s=10, clock=clock, trim=lambda pad: calls.append(pad) or 1)
    assert h.enabled
    assert not h.maybe_trim(True)  # the interval counts from construction
    clock.t += 10
    assert not h.maybe_trim(False)  # nothing finished this step
    assert h.maybe_trim(True) and calls == [0] and h.trims == 1
    clock.t += 9.5
    assert not h.maybe_trim(True)
    clock.t += 0.5
    assert h.maybe_trim(True) and h.trims == 2 and h.seconds >= 0


def test_zero_interval_or_no_glibc_turns_it_off() -> None:
    clock = Clock()
    off = HeapTrimmer(interval_s=0, clock=clock, trim=lambda pad: pytest.fail("trimmed while off"))
    clock.t += 1e6
    assert not off.enabled and not off.maybe_trim(True)
    none = HeapTrimmer(interval_s=1, clock=clock, trim=None)
    clock.t += 1e6
    assert not none.enabled and not none.maybe_trim(True) and none.trims == 0
    with pytest.raises(ValueError, match="expected >= 0"):
        HeapTrimmer(interval_s=-1, trim=None)


@pytest.mark.parametrize(("raw", "want"), [(None, 10.0), ("", 10.0), ("0", 0.0), ("2.5", 2.5)])
def test_interval_from_env(monkeypatch: pytest.MonkeyPatch, raw: str | None, want: float) -> None:
    if raw is None:
        monkeypatch.delenv(ENV, raising=False)
    else:
        monkeypatch.setenv(ENV, raw)
    assert interval_from_env() == want


@pytest.mark.parametrize("raw", ["soon", "-1", "nan"])
def test_interval_from_env_rejects_with_the_variable_named(monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    monkeypatch.setenv(ENV, raw)
    with pytest.raises(ValueError, match=f"{ENV}=.*expected seconds"):
        interval_from_env()


@pytest.mark.skipif(not sys.platform.startswith("linux") or _glibc_trim() is None, reason="needs glibc")
def test_malloc_trim_returns_holes_inside_the_heap() -> None:
    """The effect the worker relies on: free holes below the top of the heap stay resident after ``free``
    (glibc only trims the top) and go back to the OS with ``malloc_trim(0)``."""
    psutil = pytest.importorskip("psutil")
    proc = psutil.Process()
    big = bytearray(8 << 20)  # mmapped; freeing it raises glibc's dynamic mmap threshold to 8 MiB
    del big
    chunks = [bytearray(b"\x01" * (256 << 10)) for _ in range(240)]  # 60 MiB on the heap, touched
    keep = chunks[1::2]  # every other chunk stays: the freed ones are holes, and the last one pins the top
    del chunks
    rss_holes = proc.memory_info().rss
    HeapTrimmer(interval_s=1e-9, trim=True).maybe_trim(True)
    rss_trimmed = proc.memory_info().rss
    assert len(keep) == 120
    assert rss_holes - rss_trimmed > 16 << 20, (rss_holes, rss_trimmed)  # ~30 MiB of holes came back
