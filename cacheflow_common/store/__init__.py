"""Stores: one small interface, backends chosen by name."""
