"""What an operator asked of the fleet that no worker knows, kept where a successor finds it.

The workers report their sessions when a new gym-proxy adopts them (`--orphan-grace`), but
three things live only in the proxy: how many workers a resize left, which workers a
`drain` took out of new sessions until `undrain`, and the alias table (the worker a
restore put an old owner's sessions on, a decommissioned worker's heir), which routes a token
whose session no worker holds. The supervisor writes them to `fleet.json` in the runtime
directory whenever they change, and an adopting proxy reads them back, so that a crash
does not undo a resize or a drain, nor send such a token to 410. A missing file (the dead
instance never changed any) or a damaged one (said in one warning line) keeps the
command line's values.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from gym_proxy.coordinator.contract.state_files import load_document, replace_document
from gym_proxy.proxy.config import MAX_WORKERS

__all__ = ["FleetIntent", "KeptIntent", "INTENT_NAME", "load_intent", "save_intent"]

log = logging.getLogger("gym_proxy.supervisor")

INTENT_NAME = "fleet.json"


@dataclass(frozen=True, slots=True)
class FleetIntent:
    workers: int  # the slot count (after any resize)
    drained: frozenset[str] = field(default_factory=frozenset)  # owners an operator drained
    # Owner -> owner its tokens now reach (a restore's placement, a decommissioned worker's heir):
    # a token whose session no worker holds still reaches its owner's heir.
    aliases: dict[str, str] = field(default_factory=dict)


def save_intent(directory: str, intent: FleetIntent) -> None:
    """Write `intent` into `directory` at once (a crash leaves the old file or the new)."""
    document = {
        "workers": intent.workers,
        "drained": sorted(intent.drained),
        "aliases": intent.aliases,
    }
    replace_document(Path(directory) / INTENT_NAME, document)


def load_intent(directory: str) -> FleetIntent | None:
    """The intent a dead instance left in `directory`; None when it left none (or a
    damaged one, which is logged)."""
    path = Path(directory) / INTENT_NAME
    document = load_document(path, log, "the command line's worker count, no drains")
    if document is None:
        return None
    if not isinstance(document, dict):
        document = {}
    workers, drained = document.get("workers"), document.get("drained")
    aliases = document.get("aliases", {})  # a file from before aliases were kept has none
    if isinstance(workers, int) and not 1 <= workers <= MAX_WORKERS:
        log.warning(
            "%s names %d workers, not 1-%d: the command line's worker count, no drains",
            path,
            workers,
            MAX_WORKERS,
        )
        return None
    if not (
        isinstance(workers, int)
        and not isinstance(workers, bool)
        and isinstance(drained, list)
        and all(isinstance(owner, str) for owner in drained)
        and isinstance(aliases, dict)
        and all(isinstance(target, str) for target in aliases.values())
    ):
        log.warning("%s is not a fleet intent: the command line's worker count, no drains", path)
        return None
    return FleetIntent(workers, frozenset(drained), aliases)


@dataclass(eq=False)
class KeptIntent:
    """This gym-proxy's intent, written to `directory` whenever a part of it changes: the
    slot count (`resized`), the drains (`set_drained`), the router's aliases (the router
    is made with `aliases_changed` as its `on_aliases`)."""

    directory: str
    workers: int
    drained: set[str] = field(default_factory=set)  # owners an operator drained
    aliases: dict[str, str] = field(default_factory=dict)  # as the router last said them

    def adopt(self, intent: FleetIntent) -> None:
        """A predecessor's intent (adopting its workers): its drains and aliases hold
        (the adoption hands the aliases to the router, which says them back)."""
        self.workers = intent.workers
        self.drained = set(intent.drained)
        self.aliases = dict(intent.aliases)
        self.keep()  # this instance's file says it all, should it die in turn

    def aliases_changed(self, aliases: dict[str, str]) -> None:
        self.aliases = dict(aliases)
        self.keep()

    def resized(self, workers: int) -> None:
        self.workers = workers
        self.keep()

    def set_drained(self, owner: str, drained: bool) -> None:
        (self.drained.add if drained else self.drained.discard)(owner)
        self.keep()

    def forget_drains_but(self, owners: set[str]) -> None:
        """Only these owners' drains still matter (the others' workers are gone)."""
        if self.drained - owners:
            self.drained &= owners
            self.keep()

    def keep(self) -> None:
        try:
            intent = FleetIntent(self.workers, frozenset(self.drained), self.aliases)
            save_intent(self.directory, intent)
        except OSError as exc:  # the directory went away: the server goes on without it
            log.warning("could not keep the fleet's intent in %s: %s", self.directory, exc)
