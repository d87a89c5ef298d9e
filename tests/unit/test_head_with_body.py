"""`HeadWithBody`: an answer's head leaves with its body in one write, and a head with no
body behind it is not held past the loop turn it was written in."""

from __future__ import annotations

import asyncio

from fencegate.gateway.head_with_body import HeadWithBody

HEAD = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n"


class Recorded:
    """The calls a transport received, in order (enough of a transport for the wrapper)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, bytes]] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.calls.append(("write", bytes(data)))

    def writelines(self, parts: tuple[bytes, ...]) -> None:
        self.calls.append(("writelines", b"".join(parts)))

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.calls.append(("close", b""))
        self.closed = True


def wrapped() -> tuple[HeadWithBody, Recorded]:
    recorded = Recorded()
    return HeadWithBody(recorded, asyncio.get_running_loop()), recorded  # type: ignore[arg-type]


async def next_turn() -> None:
    # A future resolved by call_soon completes after the callbacks queued before it.
    done = asyncio.get_running_loop().create_future()
    asyncio.get_running_loop().call_soon(done.set_result, None)
    await done


async def test_a_head_and_its_body_leave_in_one_write() -> None:
    transport, recorded = wrapped()
    transport.write(HEAD)
    assert recorded.calls == []
    transport.write(b"{}")
    assert recorded.calls == [("writelines", HEAD + b"{}")]
    await next_turn()
    assert recorded.calls == [("writelines", HEAD + b"{}")]  # nothing written twice
    transport.write(b"more")
    assert recorded.calls[-1] == ("write", b"more")


async def test_a_head_with_no_body_behind_it_leaves_at_the_end_of_the_turn() -> None:
    transport, recorded = wrapped()
    transport.write(HEAD)
    await next_turn()
    assert recorded.calls == [("write", HEAD)]
    transport.write(b"event: 1\n\n")  # a stream's first event, later
    assert recorded.calls[-1] == ("write", b"event: 1\n\n")


async def test_an_interim_answer_is_written_at_once_and_the_real_head_held() -> None:
    transport, recorded = wrapped()
    transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
    assert recorded.calls == [("write", b"HTTP/1.1 100 Continue\r\n\r\n")]
    transport.write(HEAD)
    transport.write(b"{}")
    assert recorded.calls[-1] == ("writelines", HEAD + b"{}")


async def test_closing_writes_a_held_head_first() -> None:
    transport, recorded = wrapped()
    transport.write(HEAD)
    transport.close()
    assert recorded.calls == [("write", HEAD), ("close", b"")]
    await next_turn()
    assert recorded.calls == [("write", HEAD), ("close", b"")]


async def test_a_head_held_when_the_connection_is_lost_is_dropped() -> None:
    transport, recorded = wrapped()
    transport.write(HEAD)
    recorded.closed = True  # the client went away before the end of the turn
    await next_turn()
    assert recorded.calls == []
    assert transport.is_closing()
