"""Serving in process: the loop that owns a scorer and runs the scheduler's steps, and the JCT
profile measured on an engine."""
