"""Test support: spawned worlds, toy models, data files, fixtures shared by the test modules."""
