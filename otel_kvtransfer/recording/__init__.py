"""Runs on the engine's own threads, inside every instrumented call: turns a transfer into a record (a tuple) and
queues it. Cheap and never raises: no span, no lock held across the engine's call, no I/O. The recorder's one
thread drains the queue into the builder (`building`), here or in the builder process (`offload`: the link's
frames; `helper_lifecycle`: starting and replacing that process; `wire`: the frame format).
"""
