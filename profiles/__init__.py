"""Shipped profile databases and tuned tables, one pair per SM (package data; see README.md)."""
