"""Helpers for the tests and the bench: random checkpoints in the published layouts and a
simulated echo path. Runtime code never imports this package."""
