"""The vocabulary every layer shares, torch-free: typed errors, requests and results, labels as
tokens, what the machine is."""
