"""Runs on the engine's own threads, inside every instrumented call: turns a transfer into a record (a tuple) and
queues it. Cheap and never raises: no span, no lock held across the engine's call, no I/O. The recorder's one
thread drains the queue into a sink: the builder in this process (`building`), or the link to the builder process
(`offloading`).
"""
