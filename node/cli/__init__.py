"""The `psymesh` command line, one module per command group, on top of the SDK (control/client.py).
The only subpackage that may import daemon.py at run time (`psymesh node run` starts one).
"""
