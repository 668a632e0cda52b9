"""The scheduler is the core's (minispec/core/scheduler.py: continuous batching, preemption, and
its two extension points, `Admission` and `StepBudget`); its names are kept here for importers."""

from ..core.scheduler import Admission, Scheduler, StepBudget

__all__ = ["Admission", "Scheduler", "StepBudget"]
