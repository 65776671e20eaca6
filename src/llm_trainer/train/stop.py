"""Why and when the training loop stops early: a signal (SIGTERM/SIGINT), early stopping, a target.

A signal only sets a flag; the loop finishes its step, saves a checkpoint and stops. With several
processes, a signal seen by any rank stops every rank at the same step: its flag rides along in the
step's one collective (`train_step(share=...)`). A second Ctrl-C aborts at once.
"""

from __future__ import annotations

import contextlib
import signal
import threading

import torch

from ..logs import log


class StopControl:
    def __init__(self, world_size: int):
        self.world_size = world_size
        self.received: str | None = None  # set by the handler in this process
        self.signal: str | None = None  # acted on: the same step on every rank
        self.reason: str | None = None  # why the loop ends early, once decided

    @property
    def requested(self) -> bool:
        return self.reason is not None

    @property
    def stopping(self) -> bool:
        """This step is the last: save as for the end of the run."""
        return self.signal is not None or self.reason is not None

    def request(self, reason: str) -> None:
        """Stop after this step (early stopping, a reached target)."""
        self.reason = reason
        log(reason)

    def flag(self, device: torch.device) -> torch.Tensor:
        """This rank's vote, to be summed over ranks with the step's loss."""
        return torch.tensor([float(self.received is not None)], device=device)

    def poll(self, shared: torch.Tensor | None = None) -> None:
        """At a step boundary: act on a signal. One process reads its own flag; with several, `shared`
        (the summed flags, read at logging steps) decides, so every rank stops at the same step."""
        if self.world_size == 1:
            self.signal = self.received
        elif shared is not None and self.signal is None and bool(shared[0]):
            self.signal = self.received or "a signal on another rank"

    def end_step(self) -> None:
        """After the step's checkpoint: a signal ends the loop."""
        if self.signal is not None and self.reason is None:
            self.reason = f"received {self.signal}"

    @contextlib.contextmanager
    def signals_handled(self):
        """SIGTERM/SIGINT: finish the current step, save a checkpoint, stop. A second Ctrl-C aborts."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def handler(signum, frame):
            if self.received is not None and signum == signal.SIGINT:
                raise KeyboardInterrupt
            self.received = signal.Signals(signum).name
            log(f"{self.received}: saving a checkpoint at the end of this step, then stopping")

        previous = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            yield
        finally:
            for s, h in previous.items():
                signal.signal(s, h)
