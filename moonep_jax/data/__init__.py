"""Data shipped with moonep_jax: `corpus.txt`, the small English text the demo language model learns.

The text was written for this project (no third-party material) and is MIT licensed with the code.
"""
