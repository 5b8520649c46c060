"""Placement: which replica serves a request (sticky by session, its pin asked of the session
directory, `sessionserve/directory/`), and this process's cache of pins and replica loads."""
