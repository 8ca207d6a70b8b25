"""Helpers for testing cgx2 the way users run it: :mod:`.netlab` makes hosts with real links
on one machine."""
