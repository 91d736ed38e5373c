"""Runs once, when a process starts or stops the instrumentation: the instrumentor, the frameworks' plugin
activation, the version gate on what each wrapper needs, the choice of where spans are built.
"""
