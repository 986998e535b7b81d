"""The vocabulary every layer shares: op names, mesh axes, lax's errors, the cost model and configuration records, a leaf's reason, the residual rule."""
