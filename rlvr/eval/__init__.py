"""Evaluation: sampling-based metrics (pass@k, maj@k, avg@k, diversity) computed from n samples per prompt."""

from rlvr.eval.metrics import avg_at_k, distinct_n, maj_at_k, pass_at_k

__all__ = ["avg_at_k", "distinct_n", "maj_at_k", "pass_at_k"]
