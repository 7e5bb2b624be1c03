"""rlvr: reinforcement-learning post-training of language models, readable and CPU-first."""

__version__ = "0.1.0"
