"""The gateway's /metrics with several worker processes: every process's file is summed, and
a file a process has created but not yet sized (or never will: it died there) is skipped
rather than failing the scrape."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client.mmap_dict import MmapedDict, mmap_key

from fencegate.gateway.metrics import GatewayMetrics

REQUESTS = "fencegate_gateway_requests"


def _count_in(directory: Path, pid: int, value: float) -> None:
    """What a worker process with this pid writes for one forwarded request counter."""
    written = MmapedDict(str(directory / f"counter_{pid}.db"))  # type: ignore[no-untyped-call]  # untyped in prometheus-client
    key = mmap_key(REQUESTS, f"{REQUESTS}_total", ["decision", "problem"], ["forwarded", ""], "")
    written.write_value(key, value, 0.0)  # type: ignore[no-untyped-call]
    written.close()  # type: ignore[no-untyped-call]


def test_a_scrape_sums_every_worker_and_skips_a_file_not_yet_sized(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _count_in(tmp_path, 101, 3.0)
    _count_in(tmp_path, 102, 4.0)
    (tmp_path / "counter_103.db").touch()  # created, not yet sized: its process died there
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    page = GatewayMetrics().render().decode()
    assert f'{REQUESTS}_total{{decision="forwarded",problem=""}} 7.0' in page
