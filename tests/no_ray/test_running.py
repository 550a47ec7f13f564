"""``service.running``'s filter of Serve's long-poll traceback after ``ray stop`` (a clean-clone
run of test_stopped_from_outside_exits_1_with_a_message_and_no_ray_left printed it: "Exception
in callback LongPollClient._poll_next()" with "Can't find actor ... It might be dead")."""

from __future__ import annotations

import asyncio
import logging

from service import running


class LongPollClient:  # the name asyncio's handle repr carries, as Serve's own class
    def _poll_next(self):
        raise Exception("Failed to submit task to actor ActorID(654f) due to b\"Can't find "
                        "actor 654f. It might be dead or it's from a different cluster\"")


class Other:
    def callback(self):
        raise RuntimeError("a real error")


def _logged(callback) -> list[logging.LogRecord]:
    """What asyncio's default exception handler passes on, with the filter installed, when
    ``callback`` raises in a loop."""
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record)
    log = logging.getLogger("asyncio")
    keep = Keep()
    log.addHandler(keep)
    try:
        running.quiet_dead_controller_polls()
        running.quiet_dead_controller_polls()  # once, however often called
        assert sum(isinstance(f, running.DeadControllerPolls) for f in log.filters) == 1

        async def main():
            asyncio.get_running_loop().call_soon(callback)
            await asyncio.sleep(0.01)
        asyncio.run(main())
    finally:
        log.removeHandler(keep)
        for f in [f for f in log.filters if isinstance(f, running.DeadControllerPolls)]:
            log.removeFilter(f)
    return records


def test_the_dead_controllers_poll_traceback_is_dropped():
    assert _logged(LongPollClient()._poll_next) == []


def test_other_callback_errors_are_still_logged_with_their_traceback():
    records = _logged(Other().callback)
    assert len(records) == 1 and records[0].exc_info[0] is RuntimeError
    assert "Other.callback" in records[0].getMessage()
