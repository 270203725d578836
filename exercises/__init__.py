"""Learner stubs, generated from solutions/."""
