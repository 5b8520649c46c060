"""Offline work on models, kept out of the replica package: EAGLE drafter training."""
