"""The health monitor against real NVML: every GPU is read, and the calls the replay stands in for
answer on real hardware (or say NOT_SUPPORTED, which the monitor skips)."""

from __future__ import annotations

import threading

import pynvml

from agent.gpus.inventory import Nvml
from agent.health.monitor import HealthMonitor
from agent.health.verdicts import State


def test_real_gpus_read_healthy_with_temperature_and_ecc():
    mon = HealthMonitor(pynvml)
    try:
        gpus = mon.poll()
        assert mon.available, mon.detail
        inv = Nvml().inventory()
        assert {g.uuid for g in gpus} == {g.uuid for g in inv.gpus}
        for g in gpus:
            # A GPU lent for tests is expected to be healthy; if not, the evidence says why.
            assert g.state is State.HEALTHY, [e.detail for e in g.evidence]
            assert 0 < g.readings["temperature_c"] < 100
            assert "ecc_corrected" in g.readings or "ecc" in mon.detail
            assert g.memory_total > 0
    finally:
        mon.close()


def test_real_event_wait_returns_within_its_slice():
    mon = HealthMonitor(pynvml)
    stop = threading.Event()
    t = threading.Thread(target=mon.run, args=(stop,))
    t.start()
    stop.wait(2.5)
    stop.set()
    t.join(5)
    try:
        assert not t.is_alive(), "the monitor did not stop within one event-wait slice"
        assert mon.snapshot(), mon.detail
    finally:
        mon.close()
