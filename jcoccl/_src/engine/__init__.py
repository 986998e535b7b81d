"""The fused engine (one custom call per collective and its wire format) and the NCCL drop-in's Python side."""
