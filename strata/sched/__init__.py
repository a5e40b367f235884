"""Request scheduling, pure Python (no torch): requests, the step scheduler and what it hands the runner."""

from strata.sched.request import Request, RequestStatus
from strata.sched.scheduler import ScheduledChunk, Scheduler, SchedulerConfig, SchedulerOutput

__all__ = ["Request", "RequestStatus", "ScheduledChunk", "Scheduler", "SchedulerConfig", "SchedulerOutput"]
