"""EAGLE speculative decoding: the draft head, its checkpoints, drafting and verifying inside
the engine's step (`decoder.py`), acceptance (greedy and rejection sampling), statistics.
Training a drafter lives outside the replica package, in `sessionserve/training/`."""
