"""The native extensions: loading them (FFI targets), the backend registry of each op's implementations, and the process group."""
