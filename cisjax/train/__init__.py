"""The RL run: its config read once (spec, validate), built once (build), its services, the loop and its stages."""
