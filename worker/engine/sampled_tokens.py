"""A step's sampled tokens on their way from the device to the host.

The copy is queued behind the step (pinned host memory, non-blocking) and marked by an event, so
the host can launch the next step before it reads this one's tokens; `wait` blocks only until this
step's own work is done, not the next one's.
"""

from __future__ import annotations

import torch


class SampledTokens:
    def __init__(self, tokens: torch.Tensor, finite: torch.Tensor) -> None:
        """tokens int64 [B] and finite bool [B] (the logits row had no NaN/inf), on the step's device."""
        on_cuda = tokens.is_cuda
        stacked = torch.stack((tokens, finite.long()))  # [2, B]: one copy for both
        self._host = torch.empty(stacked.shape, dtype=torch.int64, pin_memory=on_cuda)
        self._host.copy_(stacked, non_blocking=on_cuda)
        # the end of the step's device work; timed, so the engine can measure the device's idle time after it
        self.ready: torch.cuda.Event | None = None
        if on_cuda:
            self.ready = torch.cuda.Event(enable_timing=True)
            self.ready.record()

    def wait(self) -> tuple[list[int], list[bool]]:
        """(token, logits row all finite) per row, once the step's copy has landed."""
        if self.ready is not None:
            self.ready.synchronize()
        tokens, finite = self._host.tolist()
        return tokens, [bool(f) for f in finite]
