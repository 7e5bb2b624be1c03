"""What the `rlvr` commands run that import torch, one module a command, each with ``run(args)``
returning the exit status. rlvr.cli parses the arguments and imports only the module of the
command it runs, so `rlvr --help` and `rlvr config` start without torch."""
