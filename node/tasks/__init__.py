"""Delegated tasks, both sides: the executor (a home running paired peers' tasks), the submitter
(a phone's tasks and their results, across restarts), and their durable stores. The task conversation
itself is protocol/taskflow.py's. May import core/, net/, door/ and models/.
"""
