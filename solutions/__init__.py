"""Worked solutions: the single source for exercises/ (see tools/make_exercises.py)."""
