"""``describe()["ReplicaEvents"]``: what happened to a ``sdp_fault_tolerant_replicas`` job's replicas.

Two lists, each a JSON file in the job's output directory (``smsdp.config.host_launch``): rank 0's
membership events (``replica_events.json``: replicas that failed and in which step, the steps taken
by fewer replicas, the rejoins) and the supervisor's host restarts (``host_restarts.json``, written
by ``host_restart``). Merged in time order, each ``{"Time": datetime, "Event": ..., details}``; a
file a crash left unreadable is skipped (the job log has the same lines).
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path
from typing import Any

from smsdp.config.host_launch import EVENTS_FILE, HOST_EVENTS_FILE


def replica_events(output_dir: Path) -> list[dict[str, Any]]:
    """The job's replica events, oldest first (empty for a job without the key)."""
    merged = []
    for name in (EVENTS_FILE, HOST_EVENTS_FILE):
        try:
            events = json.loads((output_dir / name).read_text())
        except (OSError, ValueError):
            continue
        for event in events if isinstance(events, list) else []:
            if isinstance(event, dict) and isinstance(event.get("time"), (int, float)):
                merged.append(event)
    merged.sort(key=lambda e: e["time"])
    return [_shaped(e) for e in merged]


def _shaped(event: dict[str, Any]) -> dict[str, Any]:
    when = datetime.datetime.fromtimestamp(event["time"], tz=datetime.timezone.utc)
    details = {_title(k): v for k, v in event.items() if k not in ("time", "event")}
    return {"Time": when, "Event": event.get("event"), **details}


def _title(name: str) -> str:
    return "".join(part.capitalize() for part in name.split("_"))
