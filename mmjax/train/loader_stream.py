"""The base of the trainers' global-batch iterators over a `Loader` (`single_data.LoaderBatches`,
`colocated_data.PhaseBatches`): one way to stop them."""
from __future__ import annotations


class LoaderStream:
    """Holds `loader` and `_it`, the running sample stream (None before the first batch,
    after `restore` and after `close`)."""

    _it = None

    def close(self) -> None:
        """Stop the running stream (producer processes, grain threads), then the loader."""
        if self._it is not None:
            if hasattr(self._it, "close"):
                self._it.close()
            self._it = None
        self.loader.close()
