"""Declaring a work class registers it in the store."""

from __future__ import annotations

from fencegate.lease import LeaseQueue, WorkClass


async def test_declare_registers_the_class(sqlite_url: str) -> None:
    queue = await LeaseQueue.connect(sqlite_url)
    try:
        wc = queue.declare(
            WorkClass(kind="ocr", lease_seconds=20, heartbeat_seconds=5, jitter_seconds=5)
        )
        assert queue.work_class("ocr") is wc
    finally:
        await queue.close()
