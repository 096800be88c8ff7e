"""Function-calling evaluation: our JSON-lines case format (suite.py) and BFCL v4 (bfcl.py, the runner
and the names callers use; bfcl_categories, bfcl_checker, bfcl_data, bfcl_score, bfcl_oracle,
bfcl_format, bfcl_multiturn and bfcl_report, one job each).

May import formats, runtime and acting (and protocol/); nothing in agent/ imports it. Inside, the bfcl
modules import in one direction (tests/test_node_layers.py checks it).
"""
