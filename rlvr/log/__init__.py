"""Where metrics and samples go: JSONL files in the run directory and the terminal."""

from rlvr.log.sinks import ConsoleProgress, JsonlSink, ScreeningProgress

__all__ = ["ConsoleProgress", "JsonlSink", "ScreeningProgress"]
