"""Scheduling, torch-free: the policies and the batching rule (`scheduler`) and the
job-completion-time model they rank requests by (`jct`)."""
