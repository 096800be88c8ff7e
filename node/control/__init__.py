"""The owner's side: the control socket's server and its handlers (owner.py), the Python SDK that
talks to it (client.py), the dashboard, doctor, service install, and running a daemon as a child
process. May import every subpackage except cli/ (and daemon.py only for types).
"""
