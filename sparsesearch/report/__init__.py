"""Reports for people: PNG maps and plots (matplotlib, imported lazily)."""
