"""Simulation of a training step under a plan (issue 4). So far: the schedules' action orders."""
