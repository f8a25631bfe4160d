"""The intake: counts of queued and active requests, the end of every open
stream at once, and the command queue (no model, no inference thread)."""

import asyncio
import threading

import pytest

from mlx_lm_server.serving.intake import Intake
from mlx_lm_server.serving.request import (
    ErrorEvent,
    GenerationRequest,
    RequestHandle,
    ShuttingDownError,
)


def _handle() -> RequestHandle:
    return RequestHandle(GenerationRequest([1, 2, 3], 4), asyncio.get_running_loop())


def test_a_request_is_counted_queued_then_active_then_gone():
    async def run():
        intake, inserted = Intake(max_queued_requests=8), []
        a, b = _handle(), _handle()
        intake.submit(a, inserted.append)
        intake.submit(b, inserted.append)
        assert (intake.num_queued, intake.num_active) == (2, 0)
        for command in intake.take(block=False):
            command()
        assert inserted == [a, b] and not intake.idle  # still queued
        intake.started()  # a's first token
        assert (intake.num_queued, intake.num_active) == (1, 1)
        intake.finished(a, started=True)
        intake.refuse(b, None)  # cancelled before its first token
        assert (intake.num_queued, intake.num_active) == (0, 0) and intake.idle

    asyncio.run(run())


def test_close_all_ends_every_open_stream_and_refuses_new_requests():
    async def run():
        intake = Intake(max_queued_requests=8)
        done, open_ = _handle(), _handle()
        for h in (done, open_):
            intake.submit(h, lambda h: None)
        intake.finished(done, started=False)
        intake.close_all(ErrorEvent("the server is shutting down", code="shutting_down"))
        await asyncio.sleep(0)  # the posted events arrive
        assert open_.closed and open_.events.get_nowait().code == "shutting_down"
        assert not done.closed and done.events.empty()
        with pytest.raises(ShuttingDownError):
            intake.submit(_handle(), lambda h: None)

    asyncio.run(run())


def test_commands_come_out_in_order_and_wake_a_device_loop():
    intake, wake, seen = Intake(max_queued_requests=1), threading.Event(), []
    intake.attach(wake)
    intake.put(lambda: seen.append(1))
    assert wake.is_set()
    intake.put(None)
    intake.put(lambda: seen.append(2))
    commands = intake.take(block=False)
    assert commands[1] is None and len(commands) == 3
    commands[0]()
    commands[2]()
    assert seen == [1, 2] and intake.take(block=False) == []
