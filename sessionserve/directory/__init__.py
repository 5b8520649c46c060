"""The session directory: the application's one record of every session (its owner, TTL,
pin, token log and committed-turn count) and of the Responses API's stored responses, kept
by one or more detached actors (`state.py`), written through to Ray's GCS store (`store.py`)
and reached through a typed client that routes each session to its shard (`client.py`).
The ingress, the session router and the replicas (migration re-pins) all use it; it imports
none of them."""
