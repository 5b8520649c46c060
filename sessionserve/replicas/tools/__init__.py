"""Tool calls on a replica: how the model is told of tools and writes a call (`formats.py`),
and how its answer becomes calls while it streams (`parser.py`)."""
