"""The parking lot holds at most max_parked attempts; what it cannot hold is abandoned by the caller."""

from __future__ import annotations

from protos.keys import Keys
from protos.tokenrelay.v1 import queue_pb2
from worker.io.parking import ParkingLot
from worker.io.tracked import Tracked


def make_tracked(request_id: str) -> Tracked:
    request = queue_pb2.QueuedRequest(request_id=request_id)
    return Tracked.of(Keys("p"), "p:requests", f"1-{ord(request_id[0])}".encode(), request)


def test_a_full_lot_refuses_a_park_until_one_leaves() -> None:
    lot = ParkingLot(grace_s=10, max_parked=2)
    assert lot.park(make_tracked("a")) and lot.park(make_tracked("b"))
    assert not lot.park(make_tracked("c"))  # bounded: the consumer abandons "c" instead
    assert len(lot) == 2
    assert [t.request_id for t in lot.take_all()] == ["a", "b"] and len(lot) == 0
    assert lot.park(make_tracked("c"))
