"""workers.decode.cuda_sync: the flag asked of the CUDA runtime, checked, and followed by events.

The runtime is replaced by a recorder (this machine has no GPU); ``bench.cuda_wait``
measures the real waits on one."""

from __future__ import annotations

import pytest
import torch

from tests.fakes import FakeRuntime
from workers.decode import cuda_sync


@pytest.fixture
def runtime(monkeypatch: pytest.MonkeyPatch) -> FakeRuntime:
    fake = FakeRuntime()
    monkeypatch.setattr(cuda_sync, "_cudart", lambda: fake)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(cuda_sync, "_blocking", False)
    return fake


@pytest.mark.parametrize(("mode", "flags"), [("auto", 0), ("spin", 1), ("yield", 2), ("block", 4)])
def test_each_mode_asks_for_its_schedule_flag(runtime: FakeRuntime, mode: str, flags: int) -> None:
    cuda_sync.set_cuda_sync(torch.device("cuda", 0), mode)  # type: ignore[arg-type]
    assert runtime.flags == flags


def test_flags_the_runtime_did_not_take_are_reported_and_events_stay_plain(
    runtime: FakeRuntime, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(runtime, "reports", 0x01)
    made: list[dict[str, bool]] = []
    monkeypatch.setattr(torch.cuda, "Event", lambda **kwargs: made.append(kwargs))
    cuda_sync.set_cuda_sync(torch.device("cuda", 0), "block")
    cuda_sync.event()
    assert "flags 0x1 after asking for 0x4" in caplog.text
    assert made == [{"enable_timing": False, "blocking": False}]


def test_a_torch_without_cuda_runtime_serves_on(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    cuda_sync._cudart.cache_clear()
    monkeypatch.setattr(torch.version, "cuda", None)  # a ROCm build's "cuda" device
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    cuda_sync.set_cuda_sync(torch.device("cuda", 0), "block")
    cuda_sync._cudart.cache_clear()
    assert "has no CUDA runtime" in caplog.text


def test_events_block_only_after_block_was_chosen(
    runtime: FakeRuntime, monkeypatch: pytest.MonkeyPatch
) -> None:
    made: list[dict[str, bool]] = []
    monkeypatch.setattr(torch.cuda, "Event", lambda **kwargs: made.append(kwargs))
    cuda_sync.event()
    cuda_sync.set_cuda_sync(torch.device("cuda", 0), "block")
    cuda_sync.event(timing=True)
    cuda_sync.set_cuda_sync(torch.device("cuda", 0), "spin")
    cuda_sync.event()
    assert made == [
        {"enable_timing": False, "blocking": False},
        {"enable_timing": True, "blocking": True},
        {"enable_timing": False, "blocking": False},
    ]


def test_the_cpu_is_left_alone(runtime: FakeRuntime) -> None:
    runtime.flags = 0x02
    cuda_sync.set_cuda_sync(torch.device("cpu"), "block")
    assert runtime.flags == 0x02
