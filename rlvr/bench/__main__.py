"""`python -m rlvr.bench PART JSON_ARGS`: one part of `rlvr bench` in a fresh process."""

from rlvr.bench import main

main()
