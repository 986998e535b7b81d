"""A Flax NNX transformer LM trained with jax.jit and NamedSharding on a (data, model) mesh,
whose data-parallel gradient sum jcoccl compresses (see docs/gspmd.md)."""
