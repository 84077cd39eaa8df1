"""The engine stop: vLLM's process manager waits while a waker sends harmless aborts; the client's own shutdown
follows; clients without the pieces are stopped as before."""

from __future__ import annotations

import threading
import types

from kda_patches.regress import engine_stop


class StalledManager:
    """A process manager whose engine core missed its SIGTERM: its shutdown returns when a wake arrives, or
    reports the stall after ``limit_s`` (what vLLM's force-kill would end)."""

    def __init__(self, limit_s: float = 10.0) -> None:
        self.processes = ["EngineCore_DP0"]
        self.woken = threading.Event()
        self.limit_s = limit_s
        self.outcome: str | None = None

    def shutdown(self, timeout: float) -> None:
        self.outcome = "woken" if self.woken.wait(self.limit_s) else "stalled"


class Client:
    """What stop_engine_core touches of vLLM's engine-core client."""

    def __init__(self, manager: object, events: list[str]) -> None:
        self.resources = types.SimpleNamespace(engine_manager=manager)
        self.events = events
        self.aborted: list[list[str]] = []

    def abort_requests(self, request_ids: list[str]) -> None:
        self.aborted.append(list(request_ids))
        self.resources.engine_manager.woken.set()

    def shutdown(self, timeout: float) -> None:
        self.events.append(f"client shutdown {timeout}")


def test_a_stalled_engine_core_is_woken_by_an_abort_of_no_request_then_the_client_shuts_down():
    events: list[str] = []
    manager = StalledManager()
    client = Client(manager, events)
    sent = engine_stop.stop_engine_core(client, timeout_s=30.0, wake_every_s=0.01)
    assert manager.outcome == "woken"
    assert sent >= 1 and client.aborted[0] == [engine_stop.WAKE_REQUEST_ID]
    assert events == ["client shutdown 30.0"]


def test_an_engine_that_exits_within_one_period_gets_no_wake():
    events: list[str] = []
    manager = types.SimpleNamespace(processes=["EngineCore_DP0"], shutdown=lambda timeout: events.append("manager"))
    client = Client(manager, events)
    assert engine_stop.stop_engine_core(client, timeout_s=5.0, wake_every_s=60.0) == 0
    assert client.aborted == [] and events == ["manager", "client shutdown 5.0"]


def test_a_client_without_a_process_manager_or_abort_is_stopped_as_before():
    events: list[str] = []
    in_process = types.SimpleNamespace(shutdown=lambda timeout: events.append(f"shutdown {timeout}"))
    assert engine_stop.stop_engine_core(in_process, timeout_s=7.0) is None
    no_processes = Client(types.SimpleNamespace(processes=[], shutdown=lambda timeout: events.append("manager")),
                          events)
    assert engine_stop.stop_engine_core(no_processes, timeout_s=8.0) is None
    assert events == ["shutdown 7.0", "client shutdown 8.0"]
    assert engine_stop.stop_engine_core(None, timeout_s=1.0) is None


def test_a_failing_wake_ends_the_waker_and_the_manager_still_decides():
    def closed(request_ids):
        raise RuntimeError("socket closed")

    stop = threading.Event()
    assert engine_stop.wake_until_set(closed, stop, 0.001) == 0
    stop.set()
    assert engine_stop.wake_until_set(lambda ids: None, stop, 0.001) == 0
