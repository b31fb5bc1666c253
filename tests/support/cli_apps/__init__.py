"""Small applications that ``tests/deploy/test_cli.py`` names as ``MODULE:ATTR`` to the CLI.

Each reads where its backend lives from the environment, set by the test that runs it.
"""
