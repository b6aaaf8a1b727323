"""Held-out evaluation of a policy on CoD packs, and the cross-domain matrix."""
