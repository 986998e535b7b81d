"""Test set-up: 8 host CPU devices, so that collectives run on 1 to 8 ranks."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
