"""Placement: which replica serves a request (sticky by session), and the shared pin directory."""
