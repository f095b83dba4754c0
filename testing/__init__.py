"""Test support for users' own tests and this project's (``source_patch.testing``):

    sglang.py          real SGLang engines and servers in processes of their own, with specs
                       active, and the tiny Qwen3-MoE checkpoint they serve
    pytest_plugin.py   the pytest plugin (entry point ``source_patch``): ``--source-patch SPEC``,
                       and the fixtures ``source_patch_import``, ``sglang_checkpoint``,
                       ``sglang_server``, ``sglang_engine``

Nothing here runs at import time of a patched module; the patcher does not import it.
"""
