"""Whether the concurrent read is on, and why not when it is not. The switch names are the ones users of
the C++ engine of the same name know.

`STRATA_PIPED_CONCURRENT=1` runs prompt reads as their own stage beside the decode loop
(`strata.runner.read_stage`). `STRATA_SPLIT_MTP_BATCH=1` computes the MTP layer's prompt K/V batched
with the read; beside the concurrent read that would run the draft K/V's projections with scratch the
read has not reserved, so the concurrent read is off unless `STRATA_PIPED_CONCURRENT_SMB=1` opts in:
then the read stage computes the draft K/V itself (`Prefill.draft_kv`) and grows its stream-K pool
before each read (`Prefill.reserve_draft_kv`), so nothing allocates on the read's path.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from strata.env import ENV

log = logging.getLogger("strata")

OFF_BESIDE_SPLIT = "STRATA_PIPED_CONCURRENT is off beside STRATA_SPLIT_MTP_BATCH"
SMB_ON = ("STRATA_PIPED_CONCURRENT_SMB=1: the batched draft K/V (STRATA_SPLIT_MTP_BATCH) runs beside the concurrent "
          "read; its MMQ pool is grown before each read")


@dataclass(frozen=True)
class ConcurrentReadSetup:
    piped_concurrent: bool = False  # STRATA_PIPED_CONCURRENT
    split_mtp_batch: bool = False  # STRATA_SPLIT_MTP_BATCH (matters with --spec)
    smb: bool = False  # STRATA_PIPED_CONCURRENT_SMB
    model_reason: str | None = None  # why this model cannot read concurrently, if it cannot

    @classmethod
    def from_env(cls, model_reason: str | None = None) -> "ConcurrentReadSetup":
        return cls(ENV.PIPED_CONCURRENT.get(), ENV.SPLIT_MTP_BATCH.get(), ENV.PIPED_CONCURRENT_SMB.get(), model_reason)

    @property
    def split_mtp_batch_reserved(self) -> bool:
        """The batched draft K/V runs beside the concurrent read, its pool reserved before each read."""
        return self.piped_concurrent and self.split_mtp_batch and self.smb and not self.model_reason

    def concurrent_read_off(self) -> str | None:
        """Why the requested concurrent read is off (None: it is on, or was not asked for)."""
        if not self.piped_concurrent:
            return None
        if self.model_reason:
            return f"STRATA_PIPED_CONCURRENT is off: {self.model_reason}"
        if self.split_mtp_batch and not self.smb:
            return OFF_BESIDE_SPLIT
        return None

    @property
    def enabled(self) -> bool:
        return self.piped_concurrent and self.concurrent_read_off() is None

    def log_decision(self) -> None:
        off = self.concurrent_read_off()
        if off:
            log.warning("%s", off)
        elif self.enabled:
            log.info("concurrent read on (STRATA_PIPED_CONCURRENT=1): prompt reads run on their own stage")
            if self.split_mtp_batch_reserved:
                log.info("%s", SMB_ON)
