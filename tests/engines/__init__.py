"""Tests of the engines behind the rollout service."""
