"""Collectives on tier groups, codecs and the byte ledger."""
