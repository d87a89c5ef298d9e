"""Keyed load from inside a host namespace: ``python -m tests.support.netns_load --gateway URL
--upstream URL --stop FILE --out FILE --progress FILE``. Retrying clients (`KeyedLoad`) run
until the stop file appears; then every answered key is replayed and the upstream's counts
read, and all of it is written to the out file as JSON."""

from __future__ import annotations

import argparse
import json
import time
import urllib.request
from pathlib import Path

from tests.support.failover_load import KeyedLoad, send


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gateway", required=True)
    parser.add_argument("--upstream", required=True)
    parser.add_argument("--stop", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--progress", type=Path, required=True)
    args = parser.parse_args()
    load = KeyedLoad([args.gateway], prefix="netns", clients=4)
    load.start()
    deadline = time.monotonic() + 120
    while not args.stop.exists() and time.monotonic() < deadline:
        # How far it got, for the test to cut and heal mid-load (written whole, then renamed).
        progress = {"answers": len(load.result.answers), "503": load.result.statuses[503]}
        partial = args.progress.with_suffix(".part")
        partial.write_text(json.dumps(progress))
        partial.replace(args.progress)
        time.sleep(0.05)
    result = load.stop()
    differ = []
    for key, answer in result.answers.items():
        entity = f"netns-entity-{key.rsplit('-', 2)[1]}"
        again = send(args.gateway, key, entity, result.accepted_fence[entity])
        if (again.status_code, again.content) != (answer.status, answer.body):
            differ.append(key)
    with urllib.request.urlopen(args.upstream + "/_stats", timeout=10) as response:
        counts = json.loads(response.read())["counts"]
    args.out.write_text(
        json.dumps(
            {
                "answers": {k: [a.sent, a.at] for k, a in result.answers.items()},
                "statuses": {str(k): v for k, v in result.statuses.items()},
                "failed": [[k, s] for k, s, _ in result.unexpected] + result.gave_up,
                "replays_differ": differ,
                "twice": sorted(k for k, v in counts.items() if v > 1),
            }
        )
    )


if __name__ == "__main__":
    main()
