"""Which worker each restored session is assigned to (no I/O).

Session records carry the owner whose worker held them at commit (`holder`), or None for
sessions that never had an owner. `session_owners` maps every owner a live cookie may
name to its holder. The assignment:

- all records of one holder go to one live worker, largest holders first, each to the
  worker with the fewest records so far;
- every owner in `session_owners` is aliased to where its holder went, even with no
  records (its cookies still need a worker);
- ownerless records are assigned one by one to the worker with the fewest records, and
  recorded in the session table of the IDs the workers keep (the app's own session table
  when the app keeps its own sessions, else gym-proxy's: `proxy.data_path.routing`, "Identity");
- `assigned_sessions` (gym-proxy sessions the table assigned before the commit) and
  `assigned_app_sessions` (the app's own sessions it assigned) follow their holder, each back
  into its own table: the two never mix.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Assignment", "assign"]


@dataclass
class Assignment:
    """The outcome: records per worker owner, the alias table and the two session
    tables (gym-proxy's, and the app's own)."""

    records: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    aliases: dict[str, str] = field(default_factory=dict)
    sessions: dict[str, str] = field(default_factory=dict)
    app_sessions: dict[str, str] = field(default_factory=dict)


def assign(
    records: list[dict[str, Any]],
    session_owners: dict[str, str],
    assigned_sessions: dict[str, str],
    workers: list[str],
    assigned_app_sessions: dict[str, str] | None = None,
    app_keyed: bool = False,
) -> Assignment:
    """Assign restored session records to `workers` (live owner IDs, in slot order).
    `app_keyed`: the records' session IDs are the app's own (module docstring)."""
    if not workers:
        raise ValueError("no live worker to restore onto")
    result = Assignment(records={w: [] for w in workers})
    load = dict.fromkeys(workers, 0)
    order = {w: i for i, w in enumerate(workers)}

    def lightest() -> str:
        return min(workers, key=lambda w: (load[w], order[w]))

    sizes = Counter(r["owner"] for r in records if r.get("owner") is not None)
    holders = set(sizes) | set(session_owners.values())
    where: dict[str, str] = {}
    for holder in sorted(holders, key=lambda h: (-sizes.get(h, 0), h)):
        target = lightest()
        where[holder] = target
        load[target] += sizes.get(holder, 0)
    for owner, holder in session_owners.items():
        result.aliases[owner] = where[holder]
    for holder, target in where.items():
        result.aliases.setdefault(holder, target)
    kept = result.app_sessions if app_keyed else result.sessions
    for record in records:
        holder = record.get("owner")
        if holder is None:
            target = lightest()
            load[target] += 1
            kept[record["session_id"]] = target
        else:
            target = where[holder]
        result.records[target].append(record)
    for table, placed in (
        (result.sessions, assigned_sessions),
        (result.app_sessions, assigned_app_sessions or {}),
    ):
        for session_id, holder in placed.items():
            if holder in where:
                table.setdefault(session_id, where[holder])
    return result
