"""The example configs shipped with rlvr (`rlvr train --config demo`), the data they read
(data/) and the agent one of them trains (agents_sdk_calculator.py). From a clone they are also
at configs/ (a link here)."""
