"""The fleet semaphore on Kubernetes: numbered places that nodes across the fleet take, one
ConfigMap each.

Two pools use it, with their own rules on top: the quarantine budget's slots (budget.py: at most
the budget's limit out of service) and the repair ladder's reboot slots (stores/slots.py: at most
N nodes rebooting). A place is the ConfigMap `<prefix><k>`:

- claimed by a create: the API server refuses a name that exists (409 AlreadyExists) atomically,
  so however many nodes claim at once there are never more holders than names, and claimers that
  try different names do not queue on one object;
- freed by a delete with the holder's uid as precondition: a place someone has taken since (a
  takeover, or a count that freed and gave it) is never freed by its old holder (409);
- read by one label-selected list (consistent), or one consistent get of a name.

A node holds one place. Two claims for one node that missed each other's create (two daemons on
one node) each took one; `keep_lowest` keeps the node's lowest and frees the rest, so every
daemon that settles the same node keeps the same place.

Which free index a claimer tries, which holder may be displaced (one past its ttl for the reboot
slots; one whose node the budget's count finds in service) and what a place's data holds are the
pools' rules, in their modules. The claim and the release are here only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Generic, Mapping, Optional, Protocol, TypeVar

from screener.stores.kube.calls import ApiCaller


class Holding(Protocol):
    """What a pool's parser reads from a place: its index and the node holding it."""

    @property
    def index(self) -> int: ...

    @property
    def node(self) -> str: ...


C = TypeVar("C", bound=Holding)


@dataclass(frozen=True)
class Place(Generic[C]):
    """A taken place: the pool's claim as parsed, and the object's uid (the release's
    precondition)."""

    claim: C
    uid: str


class Semaphore(Generic[C]):
    """One pool of places. name: the ConfigMap name of index k; selector: the label selector
    that lists exactly the pool's places; parse: the pool's claim from a ConfigMap, None for one
    that is no claim of this pool (hand-made, or of another format: it holds no node's place)."""

    def __init__(self, calls: ApiCaller, *, what: str, selector: str,
                 name: Callable[[int], str],
                 parse: Callable[[Mapping[str, Any]], Optional[C]]) -> None:
        self.calls, self.what, self.selector = calls, what, selector
        self.name, self.parse = name, parse

    def places(self) -> dict[int, Place[C]]:
        """The pool's claims by index (one consistent, label-selected list)."""
        out: dict[int, Place[C]] = {}
        for cm in self.calls.cm_list(f"list the {self.what}", self.selector):
            claim = self.parse(cm)
            if claim is not None:
                out[claim.index] = Place(claim, str((cm.get("metadata") or {}).get("uid") or ""))
        return out

    def names(self) -> list[str]:
        """The names of the pool's places as the API server's cache shows them (a moment behind):
        which places look taken, for a pick after a lost race, at a fraction of a list's bytes."""
        return self.calls.cm_names(f"list the {self.what}' names", self.selector, cached=True)

    def take(self, body: Mapping[str, Any]) -> Optional[C]:
        """Claim the place `body` names by creating it: the claim as the server stored it, None
        when the name is taken (by another claimer, or by our own earlier create whose answer
        was lost: `look` tells which)."""
        if (body.get("metadata") or {}).get("resourceVersion"):
            raise ValueError(f"{self.what}: a place is claimed by a create, never an update")
        created = self.calls.cm_write(dict(body))
        return self.parse(created) if created is not None else None

    def look(self, index: int) -> Optional[dict[str, Any]]:
        """The object under place `index`'s name as it stands (a consistent get), None when
        there is none."""
        return self.calls.cm_get(self.name(index))

    def free(self, index: int, uid: str) -> bool:
        """Free place `index` if it is still the object `uid` names; False when it was not
        there or is another object now."""
        return self.calls.cm_delete(self.name(index), uid)

    def keep_lowest(self, node: str, *, keep: bool = True) -> tuple[Optional[C], list[C]]:
        """One place per node: the node's lowest place kept (none with keep=False), every other
        freed. Returns the kept claim and the claims this call freed."""
        ours = sorted((p for p in self.places().values() if p.claim.node == node),
                      key=lambda p: p.claim.index)
        kept = ours[0].claim if ours and keep else None
        freed = [p.claim for p in (ours[1:] if keep else ours) if self.free(p.claim.index, p.uid)]
        return kept, freed
