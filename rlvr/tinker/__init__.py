"""`rlvr tinker`: the Tinker training API (the ``tinker`` client on PyPI) served by rlvr's own
engine, learner, losses and checkpoints, so code written for Tinker runs on a laptop CPU.
docs/interop.md ("Tinker") says what is supported and how to point the cookbook at it."""
