"""Whole programs: jcoccl.compress's jaxpr rewrite and the GSPMD entry point."""
