"""EAGLE speculative decoding: the draft head, its checkpoints, drafting inside the engine's
step, acceptance (greedy and rejection sampling), statistics, and CPU training."""
