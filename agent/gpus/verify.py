"""Verify before trust: a GPU runs its self-test (agent.gpus.selftest) before it takes a job moving
in (Prepare), and idle GPUs run it on a schedule so that a spare's verdict is ready before a
failure needs it.

A verdict is cached for `[verify] cache_s`; a GPU whose verdict is older is tested again before
it is leased. The NVML half of the check (XID events, row remaps and their headroom, ECC, the
PCIe link, clocks and throttle reasons) is the health monitor's, always current: a GPU it does
not judge healthy is never offered (agent.gpus.ledger), so this module adds only what NVML cannot
see. A GPU that fails is quarantined with the evidence, which is what every placement reads.

Where the self-test cannot run (no kernels built, no cuda-bindings), `selftest = "auto"` takes
the GPU on its NVML state alone and says so in its verdict (`ferry health`, `ferry doctor`);
`"required"` refuses the lease instead; `"off"` never tests.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from agent.errors import InvalidArgumentError, RefusedError
from agent.gpus import selftest

log = logging.getLogger(__name__)

SELFTEST_MODES = ("auto", "required", "off")


@dataclass(frozen=True)
class VerifyConfig:
    """`[verify]`: the checks a node runs before it is trusted with a job."""

    #: "auto" (where the kernels and cuda-bindings are installed), "required" or "off".
    selftest: str = "auto"
    #: The share of a GPU's free memory its pattern test covers.
    share: float = 0.05
    #: One self-test's bound; a GPU that takes longer fails. Below Prepare's 60 s deadline.
    timeout_s: float = 30.0
    #: A passed verdict stands this long; an older one is tested again before a lease.
    cache_s: float = 3600.0
    #: Idle GPUs are tested again this often (0: only before a lease), within cache_s.
    every_s: float = 1800.0
    #: A move whose image is estimated above this probes its path first (agent.migration.probe).
    probe_above_mib: int = 1024
    #: The probe's size.
    probe_mib: int = 32
    #: A path slower than this (MB/s) is refused before anything freezes.
    path_min_mbps: float = 100.0

    def check(self) -> VerifyConfig:
        if self.selftest not in SELFTEST_MODES:
            raise InvalidArgumentError(
                f"[verify] selftest {self.selftest!r} is not one of {', '.join(SELFTEST_MODES)}"
            )
        if not 0 < self.share <= 0.9:
            raise InvalidArgumentError(f"[verify] share {self.share:g} must be above 0 and at most 0.9")
        if not 0 < self.timeout_s <= 40:
            raise InvalidArgumentError(
                f"[verify] timeout_s {self.timeout_s:g} must be above 0 and at most 40: a lease's "
                "self-test runs inside Prepare, whose deadline is 60 s"
            )
        if self.every_s and not 0 < self.every_s < self.cache_s:
            raise InvalidArgumentError(
                f"[verify] every_s {self.every_s:g} must be below cache_s ({self.cache_s:g}), or 0: an "
                "idle spare's verdict must not lapse between two tests"
            )
        if self.cache_s <= 0 or self.probe_above_mib < 0 or self.probe_mib <= 0 or self.path_min_mbps < 0:
            raise InvalidArgumentError(
                "[verify] cache_s and probe_mib must be above 0, probe_above_mib and path_min_mbps not below"
            )
        return self


@dataclass(frozen=True)
class Verdict:
    uuid: str
    at: float  # when it was reached (unix seconds)
    problems: tuple[str, ...] = ()  # what is wrong (empty: passed)
    figures: selftest.SelfTest | None = None
    untested: str = ""  # why no self-test ran (the GPU is then taken on NVML alone)

    @property
    def passed(self) -> bool:
        return not self.problems

    def describe(self) -> str:
        if self.problems:
            return "; ".join(self.problems)
        if self.untested:
            return f"not self-tested ({self.untested})"
        f = self.figures
        assert f is not None
        tested = f"{f.memory_bytes / 2**30:.2f} GiB tested at {f.memory_gbps:.0f} GB/s"
        return f"passed: {tested}, {f.tflops:.1f} TFLOP/s"


Runner = Callable[[str, float, float], selftest.SelfTest]


class GpuVerifier:
    """The one place a GPU's self-test runs and its verdict is kept."""

    def __init__(
        self,
        config: VerifyConfig,
        quarantine: Callable[[str, str], bool],  # the ledger's quarantine_gpu
        record: Callable[[str, str, str], None],  # (kind, message, gpu): the event log
        runner: Runner | None = None,
        unavailable: Callable[[], str] | None = None,
        clock: Callable[[], float] = time.time,
        observe: Callable[[Verdict], None] = lambda v: None,
    ) -> None:
        self.config = config
        self.quarantine = quarantine
        self.record = record
        # Looked up at each call, not bound here: a test entry point may stand in for the driver.
        self.runner = runner or (lambda u, share, timeout: selftest.run(u, share, timeout))
        self.unavailable = unavailable or (lambda: selftest.unavailable())
        self.clock = clock
        self.observe = observe
        self._lock = threading.Lock()
        self._verdicts: dict[str, Verdict] = {}
        self._testing: dict[str, threading.Lock] = {}  # one self-test per GPU at a time

    def verdicts(self) -> dict[str, Verdict]:
        with self._lock:
            return dict(self._verdicts)

    def forget(self, uuid: str) -> None:
        """The GPU was cleared by hand (`ferry gpus --clear`): its next lease tests it afresh."""
        with self._lock:
            self._verdicts.pop(uuid, None)

    def require(self, uuids: Iterable[str], for_what: str) -> None:
        """Before `for_what` takes these GPUs: each passes (a cached verdict, or a self-test now,
        all at once) or the call raises RefusedError with the evidence, the failed ones quarantined."""
        if self.config.selftest == "off":
            return
        verdicts = self.check(list(uuids), self.config.cache_s)
        failed = [v for v in verdicts if v.problems]
        if failed:
            shown = "; ".join(f"GPU {v.uuid}: {v.describe()}" for v in failed)
            raise RefusedError(
                f"{len(failed)} GPU(s) failed their self-test before taking {for_what} ({shown}); "
                "quarantined",
                step="prepare self-test",
                hint="another node or GPU must take it; `ferry gpus --clear UUID` once the GPU is fixed",
            )
        if self.config.selftest == "required" and (untested := [v for v in verdicts if v.untested]):
            raise RefusedError(
                f"this node cannot self-test its GPUs ({untested[0].untested}) and [verify] selftest is "
                "required",
                step="prepare self-test",
                hint='build the kernels (`make native`), install cuda-bindings, or set selftest = "auto"',
            )

    def idle_round(self, idle: Iterable[str]) -> list[Verdict]:
        """The schedule's pass over the idle GPUs: those not tested within every_s are tested now."""
        if self.config.selftest == "off" or not self.config.every_s:
            return []
        return self.check(list(idle), self.config.every_s)

    def check(self, uuids: list[str], max_age_s: float) -> list[Verdict]:
        """Each GPU's verdict, no older than `max_age_s` (tested now where it is); a failure is
        quarantined and recorded once per test."""
        if not uuids:
            return []
        with ThreadPoolExecutor(len(uuids), thread_name_prefix="selftest") as pool:
            return list(pool.map(lambda u: self._verdict(u, max_age_s), uuids))

    def _verdict(self, uuid: str, max_age_s: float) -> Verdict:
        with self._lock:
            gate = self._testing.setdefault(uuid, threading.Lock())
        with gate:  # a second caller waits for the test under way and takes its verdict
            with self._lock:
                old = self._verdicts.get(uuid)
            if old is not None and self.clock() - old.at < max_age_s:
                return old
            v = self._test(uuid)
            with self._lock:
                self._verdicts[uuid] = v
        self.observe(v)
        if v.problems:
            why = f"self-test: {v.describe()}"
            if self.quarantine(uuid, why):
                self.record("quarantine", f"GPU {uuid} quarantined: {why}", uuid)
            self.record("verify", f"GPU {uuid} failed its self-test: {v.describe()}", uuid)
        elif v.untested and (old is None or not old.untested):
            self.record("verify", f"GPU {uuid} is not self-tested here: {v.untested}", uuid)
        return v

    def _test(self, uuid: str) -> Verdict:
        now = self.clock()
        if why := self.unavailable():
            return Verdict(uuid, now, untested=why)
        cfg = self.config
        try:
            got = self.runner(uuid, cfg.share, cfg.timeout_s)
        except selftest.SelfTestUnavailable as e:
            return Verdict(uuid, now, untested=str(e))
        except Exception as e:  # it hung, faulted or the driver refused it: the GPU's failure
            log.warning("self-test of GPU %s failed: %s", uuid, e)
            return Verdict(uuid, now, problems=(str(e),))
        log.info("self-test of GPU %s: %s", uuid, got)
        return Verdict(uuid, now, tuple(selftest.judge(got)), got)
