"""What a program does and costs: explain, wire bytes, info, calibration, the codec conformance CLI."""
