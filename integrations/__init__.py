"""Glue between source-patch and the orchestrators that start trainer and engine
processes for it (optional dependencies, imported only by their users).

    ray.py   Ray actors: runtime_env from specs and settings, the weight-sync
             rendezvous once placement is known, every actor's status and dump / trace
             endpoints from the driver, routing records from several nodes in one folder

The runtime and the patcher import nothing from here (tests/test_layout.py).
"""
