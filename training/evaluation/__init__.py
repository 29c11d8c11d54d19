"""Evaluation jobs: LFW verification, the MegaFace Challenge 1 protocol and cosine-threshold
calibration, with the landmark/embedding cache and the report writer they share."""
