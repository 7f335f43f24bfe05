"""Prompts shared by tests of batching and privacy."""

from __future__ import annotations


SYSTEM = [151644, 8948, 198, 2610, 525, 264, 10950, 17847, 13, 151645, 198, 151644, 872, 198]  # a chat's system turn
