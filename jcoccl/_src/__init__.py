"""jcoccl internals. The public API lives in :mod:`jcoccl`."""
