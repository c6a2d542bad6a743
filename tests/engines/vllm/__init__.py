"""Tests of the vLLM engine: its engine thread, platform choices and routing capture."""
