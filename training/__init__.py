"""Training, export and evaluation jobs (these may import torch)."""
