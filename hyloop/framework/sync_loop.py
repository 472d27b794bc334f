"""The synchronous loop: schedule, launch and resolve each step on the calling thread."""

from __future__ import annotations

from hyloop.framework.batch import Batch
from hyloop.framework.pipeline import StepPipeline
from hyloop.framework.recorder import StepRecorder
from hyloop.framework.request import RequestOutput


def run_blocking(
    pipeline: StepPipeline, recorder: StepRecorder, batch: Batch, since: float
) -> list[RequestOutput]:
    """Prepare, launch and resolve ``batch`` on this thread (its scheduling began at ``since``)."""
    pending = pipeline.prepare(batch)
    try:
        launched = pipeline.launch(pending)
    except BaseException:
        pipeline.abandon(pending)
        raise
    outputs = pipeline.resolve(launched)
    recorder.completed(launched.timing)
    recorder.account(batch, launched.timing, since)
    return outputs


class SyncLoop:
    """One step per call, resolved before it returns: nothing is in flight between calls."""

    def __init__(self, pipeline: StepPipeline, recorder: StepRecorder) -> None:
        self.pipeline = pipeline
        self.recorder = recorder

    @property
    def busy(self) -> bool:
        return False

    def step(self) -> list[RequestOutput]:
        t0 = self.recorder.now()
        batch = self.pipeline.schedule()
        if batch is None:
            return []
        return run_blocking(self.pipeline, self.recorder, batch, t0)

    def close(self) -> None:
        return None
