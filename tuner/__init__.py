"""Measurement, sweeps, the profile database and export of tuned tables."""
