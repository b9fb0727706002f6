"""Gradient probing of attention sections (TriangleMix, paper 002 section 2.3)."""
