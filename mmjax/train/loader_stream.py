"""The base of the trainers' global-batch iterators over the run's sample stream
(`single_data.LoaderBatches`, `colocated_data.PhaseBatches`): one way to stop them."""
from __future__ import annotations


class LoaderStream:
    """Holds `stream` (a `SampleStream`) and `_it`, what it delivers (None before the first
    batch, after `restore` and after `close`)."""

    _it = None

    def close(self) -> None:
        """Stop the running delivery (producer processes, grain threads)."""
        if self._it is not None:
            if hasattr(self._it, "close"):
                self._it.close()
            self._it = None
