"""How a runner's steps reach the devices: `LocalTransport`, in this process (the default; a
multi-host job's front has its own: jaxserve.parallel.multihost_front)."""
from __future__ import annotations

from typing import Callable, Sequence

from jaxserve.core.step import Bucket


class LocalTransport:
    """How the runner's steps reach the devices: here, in this process (the default). A
    multi-host job's front passes its own (jaxserve.parallel.multihost_front: each step sent to the
    worker processes first) through `ModelRunner.use_transport`."""

    def run(self, run_step: Callable, bucket: Bucket, arrays: dict, sampling: dict, grammars: Sequence,
            prompt_rows: dict | None):
        """The step's device outputs: `run_step` (ModelRunner.run_step) on these inputs."""
        return run_step(bucket, arrays, sampling, grammars, prompt_rows)

    def can_recover(self) -> bool:
        """Whether a failed step may be recovered from (`ModelRunner.recover`)."""
        return True

    def failure(self) -> str | None:
        """Why no step can run any more (the executor failed for good), or None."""
        return None

    def health(self) -> dict:
        """What the executor adds to /health: {} for this process alone."""
        return {}
