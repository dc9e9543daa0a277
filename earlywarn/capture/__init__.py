"""Gradients -> statistics, on the device (torch only)."""
